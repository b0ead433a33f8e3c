#!/usr/bin/env bash
# Rollover traces on the product path (issue 16): scripts/trace_rollover.py, keyframes all with the
# spare's catch-up (SPARE_BEHIND 1) and without it (99), then flow (1,000 frames: one rollover).
#   (GPU machine, repository root, .whl carried)  bash scripts/device/run_trace.sh [extra options]
set -uo pipefail
source scripts/device/env.sh
trace() { local name=$1; shift; echo "== $name: $*" | tee -a "$OUT/trace.log"
  python3 scripts/trace_rollover.py --video-dir /tmp "$@" --json "$OUT/trace_$name.json" 2>&1 | grep -v Warn \
    > "$OUT/trace_$name.log"; grep -A20 "steady FPS" "$OUT/trace_$name.log" | head -8 | tee -a "$OUT/trace.log"; }
trace all_behind1 --frames 700 --viewer --client --no-engine-run --spare-behind 1 "$@"
trace all_behind99 --frames 700 --viewer --client --no-engine-run --spare-behind 99 "$@"
trace flow --frames 1000 --keyframes flow --flow-threshold 1e9 --max-gap 3 --viewer --client --no-engine-run "$@"
