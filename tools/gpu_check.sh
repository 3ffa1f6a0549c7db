#!/usr/bin/env bash
# The course's checks on a GPU machine, natively and as a Colab T4 (LESSONLIB_GPU_PROFILE=t4): the unit tests of
# the kernels, then every notebook under nbval, each notebook's peak GPU memory appended to $LOG_DIR/peak-memory.jsonl.
#   bash tools/gpu_check.sh [tests|notebooks|all] [native|t4|l4|a100 ...]   (outputs under $LOG_DIR, default ./scratch/gpu-check)
set -uo pipefail
what=${1:-all}; shift || true
profiles=("${@:-native t4}")
read -r -a profiles <<< "${profiles[*]}"
log_dir=${LOG_DIR:-scratch/gpu-check}
mkdir -p "$log_dir"
python=${PYTHON:-python3}
nbval=(--nbval-lax --nbval-current-env --nbval-cell-timeout=600 --nbval-sanitize-with tests/nbval_sanitize.cfg -p no:cacheprovider)
status=0
for profile in "${profiles[@]}"; do
    export LESSONLIB_GPU_PROFILE=$profile
    if [ "$what" = tests ] || [ "$what" = all ]; then
        echo "=== tests/ops, profile $profile"
        # test_compile_targets compiles for every architecture on the CPU (CI runs it): not a GPU check.
        "$python" -m pytest tests/ops -q -p no:cacheprovider --ignore=tests/ops/test_compile_targets.py 2>&1 \
            | tail -15 | tee "$log_dir/tests-$profile.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
    fi
    if [ "$what" = notebooks ] || [ "$what" = all ]; then
        for nb in notebooks/0[0-5]_*.ipynb notebooks/07_*.ipynb; do
            [ -f "$nb" ] || continue
            name=$(basename "$nb" .ipynb)
            start=$(date +%s)
            LESSONLIB_PEAK_MEMORY_LOG="$log_dir/peak-$profile-$name.jsonl" "$python" -m pytest "$nb" "${nbval[@]}" -q 2>&1 \
                | tail -30 > "$log_dir/nbval-$profile-$name.log"
            rc=${PIPESTATUS[0]}
            [ "$rc" = 0 ] || status=1
            echo "$profile $name rc=$rc $(( $(date +%s) - start ))s $(tail -1 "$log_dir/nbval-$profile-$name.log") peak=$(cat "$log_dir/peak-$profile-$name.jsonl" 2>/dev/null | tail -1)"
        done
    fi
done
exit $status
