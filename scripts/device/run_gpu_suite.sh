#!/usr/bin/env bash
# One call on the GPU machine (environment: env.sh): the GPU tests, then the benchmark with the live
# viewer attached in alternating blocks. Writes logs under $OUT.
#   (on the GPU machine, from the repository root)  bash scripts/device/run_gpu_suite.sh
set -uo pipefail
source scripts/device/env.sh
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_flashinfer.py tests/test_gpu_fast_path.py ${GPU_TESTS_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
python3 scripts/bench.py --attention ${BENCH_ATTENTION:-auto} --frames ${BENCH_FRAMES:-80} --viewer \
  --json "$OUT/bench_viewer.json" 2>&1 | grep -v Warn | tee -a "$OUT/bench.log"
