#!/usr/bin/env bash
# Install from scratch (idempotent), lint, and run the whole test suite, slow integration tests included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
ruff check src tests bench
ruff format --check src tests bench
python -m pytest -q "$@"
