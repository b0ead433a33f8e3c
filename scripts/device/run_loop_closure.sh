#!/usr/bin/env bash
# The loop-closure acceptance measurement on a GPU machine: scripts/bench_loop_closure.py, 3,000 frames,
# --loop-closure off and on in one process. Carry .carry-gtsam/ (FlashInfer, apache-tvm-ffi and plyfile
# wheels, and gtsam-py312.tar.xz: GTSAM's py3.12 wheel without its example data, tests and gtsam_unstable,
# which fits the transfer where the 34 MB wheel does not). Writes $OUT/loop_closure.json.
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry-gtsam/*.whl
tar -xJf .carry-gtsam/gtsam-py312.tar.xz -C /tmp/site
mkdir -p /tmp/sr/stream_recon
for d in app models cache configs; do ln -sfn "$PWD/$d" /tmp/sr/stream_recon/$d; done
export PYTHONPATH=/tmp/sr:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import gtsam, flashinfer; print('gtsam', gtsam.Similarity3, 'flashinfer', flashinfer.__version__)"
python3 scripts/bench_loop_closure.py --frames "${FRAMES:-3000}" --json "$OUT/loop_closure.json" "$@"
