#!/usr/bin/env bash
# Flow keyframes' rollovers on a keyframe-dense and a keyframe-sparse video, and keyframes `all`
# (518x392, 1,000 frames, every output written, viewer with a client, one process each; the first
# run on the machine also compiles), then the GPU tests of the spare engine.
#   (GPU machine, repository root, .whl carried)  bash scripts/device/run_dense_flow.sh
set -uo pipefail
source scripts/device/env.sh
common="--frames 1000 --video-size 640x480 --viewer --client --no-engine-run"
e2e flow_dense $common --keyframes flow --flow-threshold ${DENSE_THRESHOLD:-4}
e2e flow_sparse $common --keyframes flow --flow-threshold 1e9 --max-gap 3
e2e all $common
rm -rf /tmp/site/_pytest /tmp/site/pytest* /tmp/site/pluggy*
python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_fast_path.py -k "${TEST_K:-spare or lookahead}" \
  2>&1 | grep -v Warn | tail -8 | tee "$OUT/tests.log"
