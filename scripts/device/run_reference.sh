#!/usr/bin/env bash
# The engine beside the official code, one process per input height (HEIGHTS, default "378 392": the
# bars of 518x378 and 518x392), then the GPU tests that guard the kernels and the official outputs in
# the time left of LIMIT_S (default 585). `.reference/lingbot-map` is the official repository's
# gct_profile.py and lingbot_map/ (ignored; carried with .whl).
#   (GPU machine, repository root, .whl and .reference carried)  [HEIGHTS=...] [TEST_K=...] bash scripts/device/run_reference.sh
set -uo pipefail
began=$(date +%s)
source scripts/device/env.sh
for height in ${HEIGHTS:-378 392}; do
  echo "== 518x$height ($(( $(date +%s) - began )) s)"
  timeout 200 python3 scripts/bench.py --frames 80 --height "$height" --reference .reference/lingbot-map \
    --json "$OUT/reference_$height.json" 2>&1 | grep -v Warn | tail -12
done
left=$(( ${LIMIT_S:-585} - ($(date +%s) - began) ))
echo "== GPU tests ($(( $(date +%s) - began )) s, $left s left)"
timeout "$left" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_path.py \
  -k "${TEST_K:-gluon or golden or official_outputs or graph_replay}" 2>&1 | tail -15
