#!/usr/bin/env bash
# The GPU tests on the GPU machine (one call), logs under $OUT; TESTS and pytest arguments narrow them.
#   (GPU machine, repository root, .whl carried)  bash scripts/device/run_gpu_tests.sh [-k EXPR ...]
set -uo pipefail
source scripts/device/env.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -s -p no:cacheprovider --durations=20 ${TESTS:-tests/test_gpu_fast_path.py tests/test_gpu_flashinfer.py} \
  "$@" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "vs golden|vs eager|sigma|passed|failed|Error|error|FAILED|PASSED|^E |s call" | tail -80
