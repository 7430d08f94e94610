#!/usr/bin/env bash
# The main job: plain decoding against gravity on the embedded default model (SmolLM2-135M-Instruct),
# side by side, with the metrics table and a trace plot. Extra arguments go to `ngrav compare`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
ngrav compare --profile profiles/binary_search.json \
  --prompt "Write a binary search in Java and explain its time complexity." \
  --seeds 5 --plot out/compare-binary-search.png "$@"
