#!/usr/bin/env bash
# The spare engine's memory: the spare GPU tests, then the product path at 640x480 -> 518x392 (1,000
# frames, every output written, the viewer on with a client, defaults) for a baseline tree and this one
# (keyframes all), and this one with flow keyframes; one process each, one machine, one call.
# Carry .whl and .carry-base/head.tar (`git archive --format=tar BASE app models cache configs scripts`).
#   (GPU machine, repository root)  bash scripts/device/run_spare_memory.sh
set -uo pipefail
source scripts/device/env.sh
rm -rf /tmp/site/_pytest /tmp/site/pytest* /tmp/site/pluggy*
mkdir -p /tmp/base /tmp/srb/stream_recon
tar -xf .carry-base/head.tar -C /tmp/base
for d in app models cache configs; do ln -sfn /tmp/base/$d /tmp/srb/stream_recon/$d; done
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_path.py -k "spare or lookahead" 2>&1 \
  | tail -6 | tee "$OUT/tests.log"
here=$PWD
bench() {  # name root package-path options...
  local name=$1 root=$2 package=$3; shift 3
  echo "== $name: $*" | tee -a "$OUT/bench.log"
  (cd "$root" && PYTHONPATH=$package:/tmp/site timeout 200 python3 scripts/bench_e2e.py --video-dir /tmp --frames 1000 \
    --video-size 640x480 --viewer --client --no-engine-run --json "$OUT/$name.json" "$@" 2>&1 | grep -v Warn \
    | tail -25 | tee -a "$OUT/bench.log")
}
bench base_all /tmp/base /tmp/srb
bench now_all "$here" /tmp/sr
bench now_flow "$here" /tmp/sr --keyframes flow
