#!/usr/bin/env bash
# The range kernel under Nsight Compute at one size (pipes, issue, stalls; 3 and 2 key blocks in
# flight), then the stage and cut candidates at several sizes (scripts/probes/probe_range_variants.py).
#   (GPU machine, repository root, .whl carried)
#   NCU_HEIGHT=378 STAGES_HEIGHTS=378,392,518 bash scripts/device/run_range_probe.sh
set -uo pipefail
source scripts/device/env.sh
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats"
for skip in 2 5; do  # the third launch of each configuration (3 stages, then 2)
  timeout 200 ncu --clock-control none -k regex:_range_attention_kernel --launch-skip $skip --launch-count 1 $sections \
    python3 scripts/probes/probe_range_variants.py --ncu ${NCU_HEIGHT:-378} > "$OUT/ncu_$skip.txt" 2>&1
  grep -E "Duration|Issue|Issued|Executed Ipc|Pipe|Stall|Registers|Shared Memory Config|Block Limit|Achieved Occupancy|Theoretical Occupancy|Warp Cycles|No Eligible|Active Warps|Eligible Warps|SM Busy|Compute \(SM\)|Memory Throughput|ERR|rror" "$OUT/ncu_$skip.txt" | head -45
done
timeout ${PROBE_TIMEOUT:-300} python3 scripts/probes/probe_range_variants.py --stages-heights ${STAGES_HEIGHTS:-378,392,518} \
  --json "$OUT/stages.json" 2>&1 | grep -v Warn | tail -12
