#!/usr/bin/env bash
# The fast path on the GPU machine (one call): its GPU tests, then the benchmark against the
# official implementation in one process, then the same pipeline without CUDA graphs.
#   (on the GPU machine, from the repository root, with .whl and .reference carried)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/sr/stream_recon
for d in app models cache; do ln -sfn "$PWD/$d" /tmp/sr/stream_recon/$d; done
export PYTHONPATH=/tmp/sr:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -s -p no:cacheprovider ${FAST_TESTS:-tests/test_gpu_fast_path.py} 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^\s*$" | tail -40
python3 scripts/bench.py --frames ${BENCH_FRAMES:-100} ${BENCH_ARGS:-} --reference .reference/lingbot-map \
  --json "$OUT/bench_reference.json" 2>&1 | grep -v Warn | tee "$OUT/bench.log"
python3 scripts/bench.py --frames 60 --no-graphs --json "$OUT/bench_eager.json" 2>&1 | grep -v Warn | tee -a "$OUT/bench.log"
