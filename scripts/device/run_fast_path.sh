#!/usr/bin/env bash
# The fast path on the GPU machine (one call): its GPU tests, then the benchmark against the
# official implementation in one process, then the same pipeline without CUDA graphs.
#   (on the GPU machine, from the repository root, with .whl and .reference carried)
set -uo pipefail
source scripts/device/env.sh
python3 -m pytest -q -s -p no:cacheprovider ${FAST_TESTS:-tests/test_gpu_fast_path.py} 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^\s*$" | tail -40
python3 scripts/bench.py --frames ${BENCH_FRAMES:-100} ${BENCH_ARGS:-} --reference .reference/lingbot-map \
  --json "$OUT/bench_reference.json" 2>&1 | grep -v Warn | tee "$OUT/bench.log"
python3 scripts/bench.py --frames 60 --no-graphs --json "$OUT/bench_eager.json" 2>&1 | grep -v Warn | tee -a "$OUT/bench.log"
