#!/usr/bin/env bash
# Rollovers beside the stream (docs/performance-log.md, 'rollovers that do not stop the stream'), one
# call: the lookahead's GPU tests, the e2e bench for keyframes all and flow (1,000 frames, viewer and a
# client), then rollover traces of both (extra options go to the traces, e.g. --pace 1.8 or
# --main-priority 0). At most 8 files under $OUT.
#   (GPU machine, repository root, .whl carried)  bash scripts/device/run_catchup.sh [trace options]
set -uo pipefail
source scripts/device/env.sh
[ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_path.py -k "spare or lookahead" 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|^E " | tail -20
FLOW="--keyframes flow --flow-threshold 1e9 --max-gap 3"
e2e all --frames 1000 --viewer --client
e2e flow --frames 1000 $FLOW --viewer --client
trace() { local name=$1; shift; echo "== trace $name: $*" | tee -a "$OUT/e2e.log"
  timeout 200 python3 scripts/probes/trace_rollover.py --video-dir /tmp --viewer --client --no-engine-run "$@" \
    --json "/tmp/trace_$name.json" 2>&1 | grep -v Warn > "$OUT/trace_$name.log"
  grep -E "stall|steady FPS" "$OUT/trace_$name.log" | tee -a "$OUT/e2e.log"; }
trace all --frames 700 --trace-before 0.6 --trace-after 0.5 "$@"
trace flow --frames 1000 $FLOW --trace-after 1.5 "$@"
