#!/usr/bin/env bash
# A fresh machine's start, part by part, as a user's machine would have it: imports timed before and
# after the interpreter's bytecode is written for the installed packages (pip writes it at install
# time; this machine's image has none), then scripts/probes/probe_cold_start.py on empty compile caches,
# uncompiled and compiled, listing every Triton kernel the process builds, then
# scripts/probes/probe_triton_builds.py one after another and on threads.
#   (GPU machine, repository root, .whl carried)  HEIGHT=392 bash scripts/device/run_first_start.sh
set -uo pipefail
source scripts/device/env.sh
imports() { for what in "import torch" "import torch, torch._dynamo, torch._inductor.compile_fx"; do
  python3 -c "import time; t = time.perf_counter(); $what; print('$1', repr('$what'), round(time.perf_counter() - t, 2))"
  done | tee -a "$OUT/imports.log"; }
imports no_bytecode
started=$SECONDS
write_bytecode
echo "bytecode written in $((SECONDS - started)) s" | tee -a "$OUT/imports.log"
imports bytecode
imports bytecode_again
probe() { local name=$1 dir=$2; shift 2; echo "== $name" | tee -a "$OUT/cold.log"
  TORCHINDUCTOR_CACHE_DIR=$dir TRITON_CACHE_DIR=$dir/triton python3 scripts/probes/probe_cold_start.py \
    --height "${HEIGHT:-392}" --triton-builds "$@" 2>&1 | grep -v Warn | tail -3 | tee -a "$OUT/cold.log"; }
probe eager_cold /tmp/first_eager --no-compile
probe eager_warm /tmp/first_eager --no-compile
probe compiled_cold /tmp/first_compiled
for threads in 1 8; do
  TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/probes/probe_triton_builds.py --threads $threads 2>&1 | grep -v Warn \
    | tail -2 | tee -a "$OUT/cold.log"
done
