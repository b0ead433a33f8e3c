#!/usr/bin/env bash
# The share of the SMs the spare's own kernels may use (models/stream/lookahead.py, SPARE_SM_SHARE; 1: a plain
# stream on every SM), on the product path: flow keyframes, 1,000 frames 640x480 -> 518x392, a 4.6 GB
# checkpoint of the official architecture (synthetic weights), the viewer on with a client. Each run is one
# process of scripts/probes/trace_rollover.py (its spans around the rollovers and the 3 longest intervals in
# $OUT/<run>.log, bench_e2e's JSON in $OUT/e2e_<run>.json); the shares alternate, so that the machine's
# drift falls on all. RUNS lists them as <row>:<share>, rows:
#   dense     --flow-threshold 4 (>90 % keyframes), compiled (the first run compiles the size)
#   sparse    --flow-threshold 1e9 --max-gap 3 (fewer than half keyframes), compiled
#   uncompiled  dense, --compile off (what a first run streams while its size compiles)
#   fit16     dense, uncompiled, beside a process that holds all but a 16 GB card's memory
#   all       keyframes all (chunks close at a known frame), compiled
# TESTS (test files) with TEST_K (their -k) runs those GPU tests after the runs ($OUT/tests.log). All of
# $OUT is packed in $OUT/out.tar.gz at the end.
#   (GPU machine, repository root, .whl carried)  [RUNS="dense:1 dense:0.6 ..."] [LIMIT_S=570]
#   [TESTS=... TEST_K=...] bash scripts/device/run_spare_sms_ab.sh
set -uo pipefail
began=$(date +%s)
source scripts/device/env.sh
write_full_size_checkpoint
export TORCHINDUCTOR_CACHE_DIR=/tmp/machine_A TRITON_CACHE_DIR=/tmp/machine_A/triton
left() { echo $(( ${LIMIT_S:-570} - ($(date +%s) - began) )); }
declare -A options=([dense]="--flow-threshold 4 --compile on" [sparse]="--flow-threshold 1e9 --max-gap 3 --compile on"
                    [uncompiled]="--flow-threshold 4 --compile off" [fit16]="--flow-threshold 4 --compile off"
                    [all]="--keyframes all --compile on")
number=0
declare -A compiled=()  # the compile keys compiled so far in this call: flow, all
for item in ${RUNS:-dense:1 dense:0.6 sparse:0.6 sparse:1 uncompiled:1 uncompiled:0.6}; do
  row=${item%%:*} way=${item#*:} number=$((number + 1)) needs=90
  key=$([ "$row" = all ] && echo all || echo flow)
  if [[ "${options[$row]}" == *"--compile on"* && -z "${compiled[$key]:-}" ]]; then
    needs=150 compiled[$key]=1  # the first run of a compile key compiles the size
  fi
  name="${number}_${row}_${way}"
  if [ "$(left)" -lt "$needs" ]; then echo "== $name: skipped, $(left) s left"; continue; fi
  [ "$row" = fit16 ] && { wait_for_idle_gpu 60; hold_all_but 16376; }
  echo "== $name ($(( $(date +%s) - began )) s)"
  timeout "$needs" python3 scripts/probes/trace_rollover.py --longest 3 --trace-before 0.05 --trace-after 0.3 \
    --spare-sm-share "$way" --video-dir /tmp --checkpoint /tmp/ckpt/full-size.pt --viewer --client --frames 1000 \
    --video-size 640x480 --no-engine-run --keyframes flow ${options[$row]} --json "$OUT/e2e_$name.json" \
    > "$OUT/$name.log" 2>&1
  echo "   rc=$?"; grep -E "Error|error:" "$OUT/$name.log" | grep -v Warn | head -3
  [ "$row" = fit16 ] && { kill $HOG; wait $HOG 2>/dev/null; }
done

run_gpu_tests "$began"
summarize_rows keyframes steady_fps p50_ms rollovers rollovers_ahead provisional_frames \
  rollover_longest_ms rollover_longest_frame rollover_regions
pack_out
