#!/usr/bin/env bash
# Speed probes on the GPU machine: fa3 on our one-frame pages, and the compiled static parts.
set -uo pipefail
OUT=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/sr/stream_recon
for d in app models cache; do ln -sfn "$PWD/$d" /tmp/sr/stream_recon/$d; done
export PYTHONPATH=/tmp/sr:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_flashinfer.py -k random 2>&1 | tail -4 | tee -a "$OUT/probe.log"
python3 scripts/bench.py --attention flashinfer-fa3 --frames 40 --json "$OUT/bench_fa3.json" 2>&1 | grep -v Warn | tee -a "$OUT/probe.log"
python3 scripts/bench.py --attention flashinfer --frames 40 --json "$OUT/bench_fa2.json" 2>&1 | grep -v Warn | tee -a "$OUT/probe.log"
python3 scripts/bench.py --attention flashinfer-fa3 --frames 40 --compile --json "$OUT/bench_fa3_compiled.json" 2>&1 | grep -v Warn | tail -25 | tee -a "$OUT/probe.log"
