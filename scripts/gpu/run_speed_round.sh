#!/usr/bin/env bash
# One round of speed work on the GPU machine: dense-kernel probe, then the pipeline variants
# (compile on, each attention over the contiguous layout) and the reference in one process.
#   (GPU machine, repository root, .whl and .reference carried)
#   source scripts/gpu/run_speed_round.sh; bench NAME [bench.py options]; bench NAME2 ...
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
mkdir -p /tmp/sr/stream_recon
for d in app models cache; do ln -sfn "$PWD/$d" /tmp/sr/stream_recon/$d; done
export PYTHONPATH=/tmp/sr:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
[ -n "${PROBE:-}" ] && python3 scripts/gpu/probe_dense_kernels.py 2>&1 | grep -v Warn | tee "$OUT/probe.log"
bench() { local name=$1; shift; echo "== $name: $*" | tee -a "$OUT/bench.log"
  python3 scripts/bench.py --frames ${BENCH_FRAMES:-80} "$@" --json "$OUT/$name.json" 2>&1 | grep -v Warn \
    | grep -E "ours|reference|ms_per_frame|fps|peak|cold_start|attention|graphs|speedup|Error|error" | tee -a "$OUT/bench.log"; }
