#!/usr/bin/env bash
# One round of speed work on the GPU machine: dense-kernel probe, then the pipeline variants
# (compile on, each attention over the contiguous layout) and the reference in one process.
#   (GPU machine, repository root, .whl and .reference carried)
#   source scripts/gpu/run_speed_round.sh; bench NAME [bench.py options]; bench NAME2 ...
set -uo pipefail
source scripts/gpu/env.sh
[ -n "${PROBE:-}" ] && python3 scripts/gpu/probe_dense_kernels.py 2>&1 | grep -v Warn | tee "$OUT/probe.log"
bench() { local name=$1; shift; echo "== $name: $*" | tee -a "$OUT/bench.log"
  python3 scripts/bench.py --frames ${BENCH_FRAMES:-80} "$@" --json "$OUT/$name.json" 2>&1 | grep -v Warn \
    | grep -E "ours|reference|ms_per_frame|fps|peak|cold_start|attention|graphs|speedup|Error|error" | tee -a "$OUT/bench.log"; }
