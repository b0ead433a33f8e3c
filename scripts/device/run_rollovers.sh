#!/usr/bin/env bash
# Issue 16's rollover work on the GPU machine, one call: the lookahead's GPU tests, the e2e bench for
# keyframes all and flow (1,000 frames, viewer and a client), then a rollover trace. Logs under $OUT.
#   (GPU machine, repository root, .whl carried)  bash scripts/device/run_rollovers.sh
set -uo pipefail
source scripts/device/env.sh
[ -n "${SKIP_TESTS:-}" ] || python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_path.py -k "spare or lookahead" 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|^E " | tail -20
e2e() { local name=$1; shift; echo "== $name: $*" | tee -a "$OUT/e2e.log"
  python3 scripts/bench_e2e.py --video-dir /tmp "$@" --json "$OUT/e2e_$name.json" 2>&1 | grep -v Warn | tail -22 \
    | tee -a "$OUT/e2e.log"; }
python3 - <<'PY' 2>&1 | tee -a "$OUT/e2e.log"  # the alignment's host cost alone, on this machine
import time, numpy as np
from stream_recon.models.windowed import FrameRatios, median_ratio_scale
a, b = (np.random.rand(2, 16, 378, 518).astype(np.float32) + 0.5)
for _ in range(3):
    t0 = time.perf_counter(); frames = [FrameRatios.of(x, y) for x, y in zip(a, b)]; t1 = time.perf_counter()
    median_ratio_scale(frames); t2 = time.perf_counter()
    print(f"alignment alone: FrameRatios.of {1e3 * (t1 - t0) / 16:.2f} ms a frame, median of 16 {1e3 * (t2 - t1):.2f} ms")
PY
e2e all --frames 1000 --viewer --client
e2e flow --frames 1000 --keyframes flow --flow-threshold 1e9 --max-gap 3 --viewer --client
timeout 150 python3 scripts/trace_rollover.py --video-dir /tmp --frames 700 --viewer --client --no-engine-run \
  --json "$OUT/trace_all.json" 2>&1 | grep -v Warn > "$OUT/trace_all.log"; grep "stall" "$OUT/trace_all.log"
