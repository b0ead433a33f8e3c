#!/usr/bin/env bash
# Product-path measurements on the GPU machine: what `stream-recon VIDEO` delivers, beside
# the engine's own rate, in one call. JSON and logs under $OUT.
#   (GPU machine, repository root, .whl carried)  bash scripts/device/run_e2e.sh [extra bench_e2e options]
set -uo pipefail
source scripts/device/env.sh
# a fresh process on a fresh machine first: its first prediction is the cold start (no compile caches)
e2e cold --frames 200 --no-engine-run
e2e all --frames 1000 --viewer --client --sink-costs
e2e flow --frames 1000 --keyframes flow --flow-threshold 1e9 --max-gap 3 --viewer --client
