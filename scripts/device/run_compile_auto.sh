#!/usr/bin/env bash
# `--compile auto` against `--compile on` on a fresh machine, as a user meets it: the installed packages'
# bytecode written first (pip writes it at install time; this machine's image has none), a checkpoint
# file of the official architecture (synthetic weights) loaded inside the run, and each "machine" a pair
# of empty compile-cache folders. Machine A: a first run with auto (uncompiled, a child compiles the size
# beside it), the wait for the child's record after it, then a second run; machine B: a first run with on
# (compiled before the stream). scripts/bench_e2e.py, 1,000 frames of 640x480 (518x392), viewer with a
# client, every output written. BYTECODE=0 skips the bytecode; E2E_EXTRA adds bench_e2e options.
#   (GPU machine, repository root, .whl carried)  bash scripts/device/run_compile_auto.sh
set -uo pipefail
source scripts/device/env.sh
[[ ${BYTECODE:-1} == 1 ]] && write_bytecode
write_full_size_checkpoint
machine() { rm -rf "/tmp/machine_$1"; mkdir -p "/tmp/machine_$1"
  export TORCHINDUCTOR_CACHE_DIR=/tmp/machine_$1 TRITON_CACHE_DIR=/tmp/machine_$1/triton; }
run() { local name=$1; shift
  e2e "$name" --checkpoint /tmp/ckpt/full-size.pt --frames 1000 --video-size 640x480 --viewer --client \
    --no-engine-run ${E2E_EXTRA:-} "$@"; }
machine A
run auto_first --compile auto
ended=$SECONDS
for _ in $(seq 240); do ls /tmp/machine_A/stream-recon-compiled/*.compiled >/dev/null 2>&1 && break; sleep 0.5; done
echo "== the child's record $((SECONDS - ended)) s after the first run ended:" | tee -a "$OUT/e2e.log"
cat /tmp/machine_A/stream-recon-compiled/*.compiled 2>&1 | tee -a "$OUT/e2e.log"
tail -5 /tmp/machine_A/stream-recon-compiled/*.log 2>&1 | grep -v Warn | tee -a "$OUT/e2e.log"
run auto_second --compile auto
machine B
run on_first --compile on
