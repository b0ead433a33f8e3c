#!/usr/bin/env bash
# The product-path lines of "fast on every video" in one call on a fresh machine, 640x480 -> 518x392
# unless a row says otherwise, a 4.6 GB checkpoint of the official architecture (synthetic weights)
# loaded in each run, the viewer on with a client, every output written; one process a row:
#   first   the machine's first run: --compile auto on empty compile caches (it streams uncompiled while a
#           child process compiles the size), 300 frames: the 100th prediction from the process's start,
#           the longest interval after the first prediction
#   dense   flow keyframes on a keyframe-dense video (--flow-threshold 4: >90 % keyframes), compiled
#   sparse  flow keyframes where fewer than half are (--flow-threshold 1e9 --max-gap 3), compiled
#   all     keyframes all, then the engine alone on the same frames: product / engine, run.json's FPS
#           against the steady one, the peak GPU memory
#   fit16   a second process holds all but a 16 GB card's memory; flow, keyframe-dense, uncompiled (a
#           16 GB card's first run of a size: no room for the compile child): the rollovers' catch-up
#   portrait  720x1280 -> 518x518, keyframes all, then the engine alone (only if time is left)
# Rows run in that order (ROWS: a subset, e.g. "first dense") while LIMIT_S (default 540) leaves room for
# them; each row's JSON is $OUT/e2e_<row>.json, its output $OUT/<row>.log, and the summary is printed at
# the end (all of $OUT then packed in $OUT/out.tar.gz). ROW_ARGS: more bench_e2e options for every row (later options win: ROW_ARGS="--compile on" compiles
# each row's size before its stream). TESTS (test files) with TEST_K (their -k) runs those GPU tests after
# the rows ($OUT/tests.log).
#   (GPU machine, repository root, .whl carried)  [ROWS=...] [TESTS=... TEST_K=...] bash scripts/device/run_acceptance.sh
set -uo pipefail
began=$(date +%s)
source scripts/device/env.sh
write_bytecode
write_full_size_checkpoint
python3 -c "import torch; torch.load('/tmp/ckpt/full-size.pt', mmap=True, weights_only=True)" 2>&1 | grep -v Warn
export TORCHINDUCTOR_CACHE_DIR=/tmp/machine_A TRITON_CACHE_DIR=/tmp/machine_A/triton
rm -rf /tmp/machine_A
left() { echo $(( ${LIMIT_S:-540} - ($(date +%s) - began) )); }
wanted() { [[ " ${ROWS:-first dense sparse all fit16 portrait} " == *" $1 "* ]]; }
row() { local name=$1 needs=$2; shift 2
  wanted "$name" || return 0
  if [ "$(left)" -lt "$needs" ]; then echo "== $name: skipped, $(left) s left"; return; fi
  echo "== $name ($(( $(date +%s) - began )) s): $*"
  timeout "$needs" python3 scripts/bench_e2e.py --video-dir /tmp --checkpoint /tmp/ckpt/full-size.pt --viewer --client \
    "$@" ${ROW_ARGS:-} --log "$OUT/$name.stream.log" --json "$OUT/e2e_$name.json" > "$OUT/$name.log" 2>&1
  echo "   rc=$?"; grep -E "Error|error:" "$OUT/$name.log" | grep -v Warn | head -3; }

row first 150 --frames 300 --video-size 640x480 --no-engine-run --compile auto
wait_for_idle_gpu 120  # the compile child fills machine_A's caches for the compiled rows
row dense 110 --frames 1000 --video-size 640x480 --no-engine-run --keyframes flow --flow-threshold 4
row sparse 110 --frames 1000 --video-size 640x480 --no-engine-run --keyframes flow --flow-threshold 1e9 --max-gap 3
row all 150 --frames 1000 --video-size 640x480

if wanted fit16 && [ "$(left)" -gt 120 ]; then
  wait_for_idle_gpu 60
  hold_all_but 16376
  row fit16 110 --frames 1000 --video-size 640x480 --no-engine-run --compile off --keyframes flow --flow-threshold 4
  kill $HOG; wait $HOG 2>/dev/null
fi
row portrait 170 --frames 1000 --video-size 720x1280

run_gpu_tests "$began"
summarize_rows keyframes steady_fps p50_ms p99_ms run_json_fps engine_steady_fps product_over_engine \
  peak_gpu_gib peak_gpu_reserved_gib rollovers rollovers_ahead provisional_frames rollover_longest_ms \
  rollover_longest_frame longest_interval_after_first_prediction_ms first_prediction_from_process_start_s \
  prediction_100_from_process_start_s video_made_s compile_beside
pack_out
