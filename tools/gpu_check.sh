#!/usr/bin/env bash
# The course's checks on a GPU machine: the whole test suite and every notebook under nbval, natively and as the
# GPUs students have (LESSONLIB_GPU_PROFILE=t4, g4, ...), each notebook's peak GPU memory kept beside its log.
#
#   bash tools/gpu_check.sh wheels [serve]          # on a machine with the network: fill .whl/ (see below)
#   bash tools/gpu_check.sh install [serve]         # on the GPU machine: install from .whl/ only, no network
#   bash tools/gpu_check.sh tests [PROFILE...] [-- PYTEST_ARGS...]   # default profiles: native t4; args: tests
#   bash tools/gpu_check.sh notebooks [PROFILE...]  # default profiles: native t4 g4
#
# Logs and peaks go to $LOG_DIR (default scratch/gpu-check): tests-PROFILE.log (whole pytest output, with the 25
# slowest tests), nbval-PROFILE-NOTEBOOK.log, peak-PROFILE-NOTEBOOK.jsonl. Exit status 1 if anything failed.
#
# The lab's GPU machine has torch, triton, pytest, matplotlib, transformers and hypothesis but no jupyter, nbval,
# nbclient, ipykernel, ipywidgets or pytest-xdist, and no network (/work/shared/GPU-NOTES.md). `wheels` downloads
# those for its Python (cp312, manylinux x86_64) into the ignored folder .whl/ (about 20 MB with their dependencies:
# carry it, the carried tree must stay under 64 MiB); `install` installs there, with --no-index, only the wheels whose
# distribution is missing, into .gpu-site/ (a --target folder put first on PYTHONPATH by tests and notebooks: the
# system Python is externally managed, and nothing it has is shadowed). nbgrader is not shipped (SQLAlchemy,
# alembic, jupyter_server: too big for what it tests); its tests skip there, saying so. vLLM cannot travel (GBs):
# lesson 06 and tests/test_serving.py skip without it.
#
# tests: the whole `pytest tests`, tests/ops/test_compile_targets.py included. One process per profile takes longer
# than one device call (10 minutes); with pytest-xdist (carried) both profiles fit in one call, side by side:
#   LOG_DIR=$OUT bash tools/gpu_check.sh tests native -- tests -n 5 --dist loadfile &
#   LOG_DIR=$OUT bash tools/gpu_check.sh tests t4 -- tests -n 4 --dist loadfile
# (on the H200, 2026-12-04: 479 s and 437 s).
# The whole `pytest tests`: tests/ops/test_compile_targets.py included (it compiles for every architecture
# through a stand-in driver, needs no GPU, and there it checks the machine's own Triton, 3.6 on the lab's H200).
# The browser tests skip there (no Chromium, JupyterLab or Playwright), each with its reason.
#
# `wheels serve` / `install serve`: lesson 07's serving benchmark instead (tools/gpu_serving.sh): the server's
# packages (pyproject's `serve` extra) and what `transformers serve --continuous-batching` and the openai client need
# (transformers' `serving` extra: fastapi, uvicorn, pydantic, openai, rich, accelerate), at requirements-dev.txt's
# pins, with their dependencies (about 9 MB). accelerate comes without its dependencies (they are torch's and
# transformers': the machine has them; psutil is carried in case it does not). A distribution the machine has is
# left alone unless a carried wheel requires a newer one than it has (then the carried one goes first, and
# `install` says so).
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-}; shift || true
python=${PYTHON:-python3}
log_dir=${LOG_DIR:-scratch/gpu-check}
wheels=.whl
site=.gpu-site
# What the GPU machine lacks for tests and notebooks (requirements-dev.txt's pins), for its Python.
missing=("nbval>=0.11" "nbformat>=5.9" "nbclient>=0.10" "ipykernel>=6.29" "ipywidgets>=8.1" "pytest-xdist>=3.5")
# What it lacks for the serving benchmark, pinned where requirements-dev.txt pins them.
serve_pins() { grep -E '^(fastapi|uvicorn|openai)==' requirements-dev.txt; echo "pydantic>=2"; echo rich; }
serve_no_deps=("$(grep -E '^accelerate==' requirements-dev.txt)" psutil)
target_python=${TARGET_PYTHON:-3.12}

profiles=()
pytest_args=()
while [ $# -gt 0 ]; do
    if [ "$1" = -- ]; then shift; pytest_args=("$@"); break; fi
    profiles+=("$1"); shift
done

install() {
    # Only what is missing: a wheel whose distribution the machine already has is left out, so nothing shadows it.
    [ -d "$wheels" ] || { echo "gpu_check: no $wheels/ here: run 'bash tools/gpu_check.sh wheels' where there is a network, and carry $wheels" >&2; return 2; }
    local wanted
    wanted=$("$python" - "$wheels" "$site" <<'EOF'
import email, importlib.metadata, pathlib, re, sys, zipfile
from packaging.requirements import Requirement
wheels, site = sys.argv[1:]
sys.path.insert(0, site)
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
carried = {norm(w.name.split("-")[0]): w for w in sorted(pathlib.Path(wheels).glob("*.whl"))}
needs = {}  # what the carried wheels require of each distribution
for wheel in carried.values():
    with zipfile.ZipFile(wheel) as z:
        meta = email.message_from_bytes(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))))
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            needs.setdefault(norm(req.name), []).append(req)
for name, wheel in carried.items():
    try:
        have = importlib.metadata.distribution(name).version
    except importlib.metadata.PackageNotFoundError:
        print(wheel)
        continue
    too_old = [str(r) for r in needs.get(name, []) if not r.specifier.contains(have, prereleases=True)]
    if too_old:
        print(f"gpu_check: {name} {have} is here but {', '.join(too_old)} is needed: the carried one goes first",
              file=sys.stderr)
        print(wheel)
EOF
)
    if [ -n "$wanted" ]; then
        # shellcheck disable=SC2086
        "$python" -m pip install -q --no-index --no-deps --target "$site" $wanted || return 1
    fi
    local modules="nbval, nbclient, ipykernel, ipywidgets, xdist"
    [ "${1:-}" = serve ] && modules="fastapi, uvicorn, pydantic, starlette, openai, accelerate, prometheus_client, httpx"
    PYTHONPATH="$PWD/$site" "$python" -c "import $modules; print('gpu_check: $modules importable')"
}

export PYTHONPATH="$PWD/$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$log_dir"
nbval=(--nbval-lax --nbval-current-env --nbval-cell-timeout=600 --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider)
status=0
case "$what" in
    wheels)
        rm -rf "$wheels"
        download=("$python" -m pip download -q -d "$wheels" --only-binary=:all: --python-version "$target_python"
                  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
                  --platform manylinux_2_28_x86_64)
        if [ "${profiles[0]:-}" = serve ]; then
            mapfile -t pins < <(serve_pins)
            "${download[@]}" "${pins[@]}" || exit 1
            "${download[@]}" --no-deps "${serve_no_deps[@]}" || exit 1
        else
            "${download[@]}" "${missing[@]}" || exit 1
        fi
        echo "gpu_check: $(ls "$wheels" | wc -l) wheels, $(du -sh "$wheels" | cut -f1) in $wheels/ (for Python $target_python)"
        ;;
    install)
        install "${profiles[0]:-}" || exit 1
        # The start-up files (*.pth) this Python has that no package lists, recorded as at install (the grader's check).
        "$python" -m lessonlib.grading.release || exit 1
        ;;
    tests)
        [ ${#profiles[@]} -gt 0 ] || profiles=(native t4)
        [ ${#pytest_args[@]} -gt 0 ] || pytest_args=(tests)
        for profile in "${profiles[@]}"; do
            echo "=== pytest ${pytest_args[*]}, profile $profile"
            start=$(date +%s)
            LESSONLIB_GPU_PROFILE=$profile "$python" -m pytest "${pytest_args[@]}" -q -p no:cacheprovider -rs \
                --durations=25 > "$log_dir/tests-$profile.log" 2>&1
            rc=$?
            [ "$rc" = 0 ] || status=1
            grep -E "^(FAILED|ERROR)" "$log_dir/tests-$profile.log" | head -40
            echo "$profile tests rc=$rc $(( $(date +%s) - start ))s: $(tail -1 "$log_dir/tests-$profile.log")"
        done
        ;;
    notebooks)
        [ ${#profiles[@]} -gt 0 ] || profiles=(native t4 g4)
        for profile in "${profiles[@]}"; do
            for nb in notebooks/0*.ipynb; do
                name=$(basename "$nb" .ipynb)
                if [ "$name" = 06_vllm ] && ! "$python" -c "import vllm" 2>/dev/null; then
                    echo "$profile $name SKIPPED: vLLM is not installed here (lesson 06 needs it; it cannot be carried)"
                    continue
                fi
                start=$(date +%s)
                LESSONLIB_GPU_PROFILE=$profile LESSONLIB_PEAK_MEMORY_LOG="$log_dir/peak-$profile-$name.jsonl" \
                    "$python" -m pytest "$nb" "${nbval[@]}" -q > "$log_dir/nbval-$profile-$name.log" 2>&1
                rc=$?
                [ "$rc" = 0 ] || status=1
                echo "$profile $name rc=$rc $(( $(date +%s) - start ))s $(tail -1 "$log_dir/nbval-$profile-$name.log")" \
                     "peak=$(tail -1 "$log_dir/peak-$profile-$name.jsonl" 2>/dev/null)"
            done
        done
        ;;
    *)
        echo "usage: bash tools/gpu_check.sh wheels | install | tests [PROFILE...] [-- PYTEST_ARGS...] | notebooks [PROFILE...]" >&2
        exit 2
        ;;
esac
exit $status
