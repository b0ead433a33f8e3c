#!/usr/bin/env bash
# One GPU-machine session: install the carried wheels (.whl: FlashInfer, pytest, viser and their
# needs), expose the three folders as stream_recon.* without pip, run the GPU tests, then the
# benchmark with the live viewer attached in alternating blocks. Writes logs under $OUT.
#   (on the GPU machine, from the repository root)  bash scripts/gpu/run_gpu_suite.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/sr/stream_recon
for d in app models cache; do ln -sfn "$PWD/$d" /tmp/sr/stream_recon/$d; done
export PYTHONPATH=/tmp/sr:/tmp/site:${PYTHONPATH:-}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, flashinfer; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu_flashinfer.py tests/test_gpu_fast_path.py ${GPU_TESTS_ARGS:-} 2>&1 | tee "$OUT/gpu_tests.log"
python3 scripts/bench.py --attention ${BENCH_ATTENTION:-auto} --frames ${BENCH_FRAMES:-80} --viewer \
  --json "$OUT/bench_viewer.json" 2>&1 | grep -v Warn | tee -a "$OUT/bench.log"
