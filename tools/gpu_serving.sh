#!/usr/bin/env bash
# Lesson 07's serving runs on the lab's H200 (issue 26), in one device call of about 420 s at most, no network:
#
#   bash tools/gpu_check.sh wheels serve     # here, once, with the network: fills the ignored .whl/ (about 9 MB)
#   # then on the device, carrying .whl:  bash tools/gpu_serving.sh        (results and logs in $OUT)
#
# 1. installs the carried wheels the machine lacks (tools/gpu_check.sh install serve: fastapi, uvicorn, pydantic,
#    openai, accelerate, ...) into .gpu-site/, put first on PYTHONPATH;
# 2. benchmarks/bench_chunked_prefill.py (one 4,096-token prompt among 32 decodes, both schedules; about a minute,
#    and it leaves Triton's kernels compiled for the servers) -> $OUT/chunked-prefill-h200.json;
# 3. benchmarks/bench_serving.py (the course's server with and without chunked prefill, and
#    `transformers serve --continuous-batching`, at rising Poisson rates, within --budget-s) ->
#    $OUT/serving-h200.json, the servers' logs in $OUT/server-logs/.
# Each under `timeout -s INT` (an interrupted benchmark still writes what it measured); each log in $OUT. Then it
# prints issue 26's targets as each run computed them. Copy the two JSON files to lessonlib/results/ and commit them.
# SMOKE=1 runs both benchmarks with --smoke (any machine, the CPU included): this script's own dry run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-scratch/gpu-serving}
python=${PYTHON:-python3}
chunked_s=${CHUNKED_S:-110}  # bench_chunked_prefill's limit
serving_budget_s=${SERVING_BUDGET_S:-260}  # bench_serving's own plan; its limit is 30 s more (shutdown, saving)
smoke=()
[ -n "${SMOKE:-}" ] && smoke=(--smoke)
mkdir -p "$out"
began=$(date +%s)
status=0

if ! PYTHON=$python bash tools/gpu_check.sh install serve > "$out/install.log" 2>&1; then
    cat "$out/install.log"
    echo "gpu_serving: the carried wheels did not install (is .whl/ carried? bash tools/gpu_check.sh wheels serve)" >&2
    exit 1
fi
tail -3 "$out/install.log"
export PYTHONPATH="$PWD/.gpu-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # no network there: nothing waits for the Hub
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null

run() {  # run NAME LIMIT_S COMMAND...: one benchmark under timeout -s INT, its log in $out/NAME.log
    local name=$1 limit=$2; shift 2
    local start; start=$(date +%s)
    timeout -s INT -k 20 "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    [ "$rc" = 0 ] || status=1
    echo "gpu_serving: $name rc=$rc $(( $(date +%s) - start ))s"
    grep -E "Error|Traceback|wrote|target" "$out/$name.log" | tail -8
}

run bench_chunked_prefill "$chunked_s" "$python" benchmarks/bench_chunked_prefill.py \
    --out "$out/chunked-prefill-h200.json" "${smoke[@]}"
run bench_serving $(( serving_budget_s + 30 )) "$python" benchmarks/bench_serving.py \
    --out "$out/serving-h200.json" --budget-s "$serving_budget_s" --logs "$out/server-logs" "${smoke[@]}"

"$python" - "$out" <<'EOF'
import json, pathlib, sys
for name in ("chunked-prefill-h200", "serving-h200"):
    path = pathlib.Path(sys.argv[1]) / f"{name}.json"
    if not path.exists():
        print(f"gpu_serving: {name}.json was not written")
        continue
    notes = json.loads(path.read_text()).get("notes", {})
    print(f"gpu_serving: {name}: {json.dumps(notes.get('target') or notes.get('targets'))}")
    print(f"             seconds {notes.get('seconds')}, start-ups {notes.get('startup_s')}")
EOF
echo "gpu_serving: $(( $(date +%s) - began ))s in all, status $status"
exit $status
