#!/usr/bin/env bash
# The main job: plain decoding against gravity on the embedded default model (SmolLM2-135M-Instruct), in chat,
# side by side. The request names no topic, so a text can wander; gravity keeps it on space with the topic
# default (profiles/topic.yaml). The result leads with measures the pull does not define: held-out space words
# that the profile does not name, and similarity to a description it was not built from, each with a paired
# interval over the seeds; then the texts, the metrics table and a trace plot. Extra arguments go to
# `ngrav compare` (e.g. --samples 20). The article's binary-search example, after this script has set up .venv:
#   .venv/bin/ngrav compare --profile profiles/binary_search.json --prompt "Write a binary search in Java." \
#     --held-out sorted,middle,half,index
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
ngrav compare --profile profiles/topic.yaml \
  --prompt "Describe a place you like, and what you do there." \
  --held-out "moon,star,stars,sun,earth,space,sky,universe,nasa,mars,moons,solar,astronomy,comet,satellite" \
  --description "a text about space, the planets and the stars" \
  --samples 8 --max-new-tokens 128 --plot out/compare-topic.png "$@"
