#!/usr/bin/env bash
# The warm-up before the stream (the streaming step compiled and recorded on copies of the first frame)
# on the product path: 518x392 (a 640x480 video), 1,000 frames, defaults, viewer with a client; one
# process per RUNS entry name:choice (--warm-up auto|on|off) in order, the first on a fresh machine's
# empty compile caches. Then the GPU tests of the warm-up (TEST_K="" skips them).
#   (GPU machine, repository root, .whl carried)  bash scripts/device/run_warm_up.sh
set -uo pipefail
source scripts/device/env.sh
for spec in ${RUNS:-fresh:auto warm:auto off:off warm2:auto}; do
  e2e "${spec%%:*}" --frames 1000 --video-size ${VIDEO_SIZE:-640x480} --viewer --client --no-engine-run \
    --warm-up "${spec#*:}" ${E2E_EXTRA:-}
done
[[ -z ${TEST_K-x} ]] && exit 0
rm -rf /tmp/site/_pytest /tmp/site/pytest* /tmp/site/pluggy*
python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_fast_path.py -k "${TEST_K:-warm_up}" -s 2>&1 \
  | grep -v Warn > "$OUT/tests.log"; grep -E "warm-up|passed|failed|Error" "$OUT/tests.log" | tail -20
