#!/usr/bin/env bash
# The product path on every shape users bring, one process: 1,000-frame videos at 1280x720 (landscape
# phone), 640x468 (the benchmark's), 640x480 (TUM, webcams) and 720x1280 (portrait phone), every output
# written, the viewer on with a client. Each row compiles its input size in its run's warm-up, before the stream.
# WITH_ENGINE=1: each row is followed by the engine alone on its frames (product / engine in the JSON).
#   (GPU machine, repository root, .whl carried)  [WITH_ENGINE=1] bash scripts/device/run_shapes_e2e.sh [bench_e2e options]
set -uo pipefail
source scripts/device/env.sh
python3 scripts/bench_e2e.py --video-dir /tmp --frames 1000 --video-size 1280x720,640x468,640x480,720x1280 \
  --viewer --client $([ "${WITH_ENGINE:-0}" = 1 ] || echo --no-engine-run) --json "$OUT/shapes_e2e.json" "$@" 2>&1 | grep -v Warn | tail -40
