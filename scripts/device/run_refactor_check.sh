#!/usr/bin/env bash
# A refactor changes no speed: the engine (scripts/bench.py) and the product path (scripts/bench_e2e.py,
# 300 frames, viewer off) of a baseline tree and of this one, alternating, on one machine in one call.
# Carry .whl and .carry-base/base.tar (`git archive --format=tar BASE app models cache configs scripts`).
# JSON and the printed tables under $OUT.
set -uo pipefail
source scripts/device/env.sh
mkdir -p /tmp/base /tmp/srb/stream_recon
tar -xf .carry-base/base.tar -C /tmp/base
for d in app models cache configs; do ln -sfn /tmp/base/$d /tmp/srb/stream_recon/$d; done
here=$PWD
run_in() {  # tree-name root package-path command...
  local name=$1 root=$2 package=$3; shift 3
  echo "== $name: $*" | tee -a "$OUT/check.log"
  (cd "$root" && PYTHONPATH=$package:/tmp/site python3 "$@" 2>&1 | grep -v Warn | tail -14 | tee -a "$OUT/check.log")
}
run_in engine_base /tmp/base /tmp/srb scripts/bench.py --frames 100 --json "$OUT/engine_base.json"
run_in engine_now "$here" /tmp/sr scripts/bench.py --frames 100 --json "$OUT/engine_now.json"
run_in product_base /tmp/base /tmp/srb scripts/bench_e2e.py --frames 300 --no-engine-run --video-dir /tmp \
  --json "$OUT/product_base.json"
run_in product_now "$here" /tmp/sr scripts/bench_e2e.py --frames 300 --no-engine-run --video-dir /tmp \
  --json "$OUT/product_now.json"
