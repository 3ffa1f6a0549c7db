#!/usr/bin/env bash
# Set up the course on a fresh machine: a virtual environment with torch, triton, JupyterLab and the test tools,
# lessonlib installed editable, and Chromium for the real-browser test. Safe to run again.
set -euo pipefail
python=${1:-python3}
venv=${2:-.venv}
torch_spec=${3:-torch==2.13.0}

if ! command -v chromium >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq chromium >/dev/null
    else
        echo "setup: Chromium is missing; the browser test will be skipped (install Debian's 'chromium')" >&2
    fi
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# torch first, on its own, so the CPU build from the local disk is chosen rather than a CUDA build.
"$venv/bin/python" -m pip install -q "$torch_spec"
"$venv/bin/python" -m pip install -q -r requirements.txt -r requirements-dev.txt -e .
"$venv/bin/python" -c "import torch, triton; print(f'setup: torch {torch.__version__}, triton {triton.__version__}')"
