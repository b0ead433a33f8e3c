#!/usr/bin/env bash
# The spare's scale step in the time the stream leaves the device idle (models/lookahead.py,
# SCALE_STEP_IN_IDLE_TIME) against at once beside it (--spare-scale-step-at-once), on the product path:
# flow keyframes, 1,000 frames 640x480 -> 518x392, a 4.6 GB checkpoint of the official architecture
# (synthetic weights), the viewer on with a client. Each run is one process of scripts/trace_rollover.py
# (its spans around the rollovers and the 3 longest intervals in $OUT/<run>.log, bench_e2e's JSON in
# $OUT/e2e_<run>.json); the two ways alternate, so that the machine's drift falls on both:
#   dense     --flow-threshold 4 (>90 % keyframes), compiled (the first run compiles the size)
#   sparse    --flow-threshold 1e9 --max-gap 3 (fewer than half keyframes), compiled
#   uncompiled  dense, --compile off (what a first run streams while its size compiles), while time is left
#   (all of $OUT then packed in $OUT/out.tar.gz)
#   (GPU machine, repository root, .whl carried)  [LIMIT_S=570] bash scripts/device/run_scale_step_ab.sh
set -uo pipefail
began=$(date +%s)
source scripts/device/env.sh
write_full_size_checkpoint
export TORCHINDUCTOR_CACHE_DIR=/tmp/machine_A TRITON_CACHE_DIR=/tmp/machine_A/triton
left() { echo $(( ${LIMIT_S:-570} - ($(date +%s) - began) )); }
run() { local name=$1 needs=$2; shift 2
  if [ "$(left)" -lt "$needs" ]; then echo "== $name: skipped, $(left) s left"; return; fi
  echo "== $name ($(( $(date +%s) - began )) s): $*"
  timeout "$needs" python3 scripts/trace_rollover.py --longest 3 --trace-before 0.05 --trace-after 0.3 \
    --video-dir /tmp --checkpoint /tmp/ckpt/full-size.pt --viewer --client --frames 1000 --video-size 640x480 \
    --no-engine-run --keyframes flow "$@" --json "$OUT/e2e_$name.json" > "$OUT/$name.log" 2>&1
  echo "   rc=$?"; grep -E "Error|error:" "$OUT/$name.log" | grep -v Warn | head -3; }
dense=(--flow-threshold 4) sparse=(--flow-threshold 1e9 --max-gap 3)
run dense_idle 150 "${dense[@]}" --compile on
run dense_at_once 90 "${dense[@]}" --compile on --spare-scale-step-at-once
run sparse_idle 90 "${sparse[@]}" --compile on
run sparse_at_once 90 "${sparse[@]}" --compile on --spare-scale-step-at-once
run dense_at_once_2 90 "${dense[@]}" --compile on --spare-scale-step-at-once
run dense_idle_2 90 "${dense[@]}" --compile on
run uncompiled_idle 90 "${dense[@]}" --compile off
run uncompiled_at_once 90 "${dense[@]}" --compile off --spare-scale-step-at-once

python3 - "$OUT" <<'PY'
import json, pathlib, sys
keys = ("keyframes", "steady_fps", "p50_ms", "rollovers", "rollovers_ahead", "provisional_frames",
        "rollover_longest_ms", "rollover_longest_frame", "longest_stall_ms", "longest_stall_frame")
for path in sorted(pathlib.Path(sys.argv[1]).glob("e2e_*.json")):
    row = json.loads(path.read_text())
    shown = {k: row[k] for k in keys if k in row}
    if row.get("rollover_longest_ms") and row.get("p50_ms"):
        shown["rollover_over_median"] = round(row["rollover_longest_ms"] / row["p50_ms"], 2)
    shown["over_2x"] = [(item["frame"], item["ms"]) for item in row.get("over_2x_median", [])]
    print(path.stem, json.dumps(shown))
PY
pack_out
