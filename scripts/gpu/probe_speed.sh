#!/usr/bin/env bash
# Speed probes on the GPU machine (one call): attention kernels over contiguous keys, then our
# pipeline against the official one in one process, then FlashInfer's JIT-heavy candidates.
#   (on the GPU machine, from the repository root, with .whl and .reference carried)
set -uo pipefail
source scripts/gpu/env.sh
python3 scripts/bench_attention.py --groups torch --json "$OUT/attention_torch.json" 2>&1 | grep -v Warn | tee "$OUT/probe.log"
python3 scripts/bench.py --attention ${BENCH_ATTENTION:-flashinfer} --frames ${BENCH_FRAMES:-100} \
  --reference .reference/lingbot-map --json "$OUT/bench_reference.json" 2>&1 | grep -v Warn | tee -a "$OUT/probe.log"
python3 scripts/bench_attention.py --groups flashinfer --json "$OUT/attention_flashinfer.json" 2>&1 | grep -v Warn | tee -a "$OUT/probe.log"
