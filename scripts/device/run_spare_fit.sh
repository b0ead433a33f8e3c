#!/usr/bin/env bash
# The spare's provisional room fitted to a budget, and what torch.compile buys at 518x392: the spare GPU
# tests; the product path at 640x480 with flow keyframes under --gpu-memory 16GiB (1,000 frames, every
# output written, viewer and client on); the engine (scripts/bench.py, 100 steady frames) at 518x392
# compiled and not, one process each, one call.
#   (GPU machine, repository root, .whl carried)  bash scripts/device/run_spare_fit.sh
set -uo pipefail
source scripts/device/env.sh
rm -rf /tmp/site/_pytest /tmp/site/pytest* /tmp/site/pluggy*
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_path.py -k "spare or lookahead" 2>&1 \
  | tail -4 | tee "$OUT/tests.log"
timeout 200 python3 scripts/bench_e2e.py --video-dir /tmp --frames 1000 --video-size 640x480 --viewer --client \
  --no-engine-run --keyframes flow --gpu-memory 16GiB --json "$OUT/flow_16gib.json" 2>&1 | grep -v Warn | tail -22
for variant in "" "--no-compile"; do
  echo "== engine 518x392 $variant"
  timeout 200 python3 scripts/bench.py --height 392 --width 518 --frames 100 $variant \
    --json "$OUT/engine${variant:+_no_compile}.json" 2>&1 | grep -v Warn | tail -6
done
