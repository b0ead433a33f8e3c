#!/usr/bin/env bash
# The defaults on a GPU with a 16 GB card's memory: a second process holds all but 16,376 MiB of the GPU
# (what a 16 GB card reports in all), then the product path at 518x392 (keyframes all, then flow) with the
# lookahead left to `auto`; each run's log in $OUT/<name>.log, the engine's log (the spare's room, rollovers,
# out-of-memory warnings, with the allocator's state) in $OUT/<name>.stream.log, its JSON in $OUT/e2e_<name>.json.
# BUDGET=16GiB adds a flow run under --gpu-memory $BUDGET.
#   (GPU machine, repository root, .whl carried) FRAMES=1000 [BUDGET=16GiB] bash scripts/device/run_fit16.sh
set -uo pipefail
source scripts/device/env.sh
# no other process on the GPU (an earlier run's background compile, say): what it frees later would
# be free beside the run, more than a 16 GB card has
wait_for_idle_gpu 120
nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | sed 's/^/still on the GPU: /'
hold_all_but 16376
nvidia-smi --query-gpu=memory.used,memory.free --format=csv
show() { python3 - "$OUT/e2e_$1.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
keys = ["steady_fps", "p50_ms", "p99_ms", "run_json_fps", "peak_gpu_gib", "peak_gpu_reserved_gib", "rollovers",
        "rollovers_ahead", "provisional_frames", "lookahead_starts", "rollover_longest_ms", "rollover_longest_frame",
        "longest_stall_ms", "keyframes", "compile_beside", "prediction_100_from_process_start_s"]
print({k: r.get(k) for k in keys})
PY
}
run() { local name=$1; shift
  python3 scripts/bench_e2e.py --video-dir /tmp --frames ${FRAMES:-1000} --video-size 640x480 --viewer --client --no-engine-run \
    "$@" --log "$OUT/$name.stream.log" --json "$OUT/e2e_$name.json" > "$OUT/$name.log" 2>&1; echo "== $name rc=$?"
  grep -i "OutOfMemory\|Error\|memory plan" "$OUT/$name.log" | grep -v Warn | cut -c1-400 | head -3
  grep -i "ahead of rollovers\|out of device memory" "$OUT/$name.stream.log" | cut -c1-400 | head -4
  show $name; }
run fit16all
run fit16flow --keyframes flow --flow-threshold 4
[ -n "${BUDGET:-}" ] && run fit16budget --keyframes flow --flow-threshold 4 --gpu-memory "$BUDGET"
kill $HOG
