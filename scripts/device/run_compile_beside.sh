#!/usr/bin/env bash
# The compile beside the stream: its GPU test and the golden/spare tests that prepare with it off, then
# the product path at 640x480 -> 518x392 (1,000 frames, every output written, the viewer on with a
# client): first on the fresh machine (empty compile caches), then with warm caches, beside the stream
# and, for comparison in the same call, with the first streaming frame waiting for the compile.
# Carry .whl.   (GPU machine, repository root)  bash scripts/device/run_compile_beside.sh
set -uo pipefail
source scripts/device/env.sh
rm -rf /tmp/site/_pytest /tmp/site/pytest* /tmp/site/pluggy*
bench() {  # name options...
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/bench.log"
  timeout ${BENCH_TIMEOUT:-150} python3 scripts/bench_e2e.py --video-dir /tmp --frames 1000 --viewer --client \
    --no-engine-run --json "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  grep -v Warn "$OUT/$name.log" | tail -30 | tee -a "$OUT/bench.log"
}
python3 -c "
import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; from bench_e2e import make_video
for w, h in ((640, 480), (640, 468)): make_video(Path(f'/tmp/bench_e2e_1000_{w}x{h}.mp4'), 1000, w, h)"
export TORCH_LOGS=${TORCH_LOGS:-recompiles}  # a compile on the stream's thread names its guard failure
bench fresh_beside --video-size 640x480
bench warm_beside --video-size 640x480
bench warm_first --video-size 640x480 --compile-first
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -s tests/test_gpu_fast_path.py \
  -k "${TEST_K:-beside or spare or lookahead or fastest}" 2>&1 | grep -E "passed|failed|error|compiled|Error|assert" \
  | tail -20 | tee "$OUT/tests.log"
