#!/usr/bin/env bash
# The GPU machine's measurements, one entry point: `bash scripts/device/measure.sh SUITE [arguments]` from
# the repository root. Every suite sources scripts/device/env.sh (the package without pip, $OUT, the GPU
# in $OUT/gpu.txt) and takes its settings from the environment (NAME=value before the command; defaults
# below). Suites:
#   acceptance  the product-path rows of "fast on every video", one process a row (ROWS: first dense sparse
#               all fit16 portrait; ROW_ARGS; LIMIT_S 540; TESTS/TEST_K after): $OUT/e2e_ROW.json, ROW.log
#   e2e         the product path: a cold 200-frame run, keyframes all with the sinks' costs, flow (1,000
#               frames); arguments: more bench_e2e options: $OUT/e2e_{cold,all,flow}.json, e2e.log
#   shapes-e2e  the product path at 1280x720, 640x468, 640x480, 720x1280 in one process (WITH_ENGINE=1: each
#               beside the engine alone); arguments: bench_e2e options: $OUT/shapes_e2e.json
#   shapes      the engine at every input size and variant (scripts/bench_shapes.py; HEIGHTS, VARIANTS,
#               FRAMES, PROFILE, DEADLINE, LIMIT_S), beside TESTS
#   reference   the engine beside the official code at HEIGHTS (378 392), then the kernels' GPU tests
#               (TEST_K) in what LIMIT_S (585) leaves: $OUT/reference_H.json
#   engine      one run of scripts/bench.py with the arguments (e.g. --viewer, --no-graphs, --no-compile,
#               --gpu-memory 8GiB): $OUT/engine.json, engine.log
#   against     the engine (and WHAT="engine product": the product path) of another tree (OTHER=folder
#               holding its app/ models/ cache/ configs/ scripts/, or BASE_TAR=a `git archive` tar of them)
#               and of this one, alternating ROUNDS (2) times (ORDER "this other": this tree first in a round);
#               arguments: bench.py options; E2E_ARGS: bench_e2e options; CHECKPOINT=1: the product runs load
#               the full-size checkpoint file (written once, its page cache warm) instead of building synthetic
#               weights in the process: $OUT/{engine,product}_{other,this}_N.json, against.log
#   gpu-tests   the GPU tests (TESTS: tests/test_gpu_fast_path.py tests/test_gpu_flashinfer.py); arguments:
#               pytest's (-k EXPR): $OUT/gpu_tests.log
#   start       a fresh machine's start, PARTS (default first) in order: first (command start to the 100th
#               prediction, --compile auto on empty caches; ROUNDS, FRAMES 400, OLD= or TREES="name:folder"
#               alternate other trees), imports (imports before/after bytecode, the cold-start probe,
#               Triton builds; list it first), cold (probe_cold_start rows), compile (auto against on),
#               builds (the warm-up's dry pass on and off; ORDER), warm-up (WARM_UP_RUNS name:auto|on|off),
#               kept (compiled code kept between runs; KEPT_RUNS mode:name), warm (each SIZES video, of this
#               tree and TREES, each tree's own bench_e2e.py from its root: a first run on empty compile caches,
#               then the next on the caches its compile child filled; FRAMES 400); TESTS/TEST_K after
#   spare       the spare engine and rollovers, PARTS (default rows): rows (flow on keyframe-dense and
#               sparse videos, keyframes all), traces (rollover traces of all and flow; arguments: trace
#               options), fit16 (a 16 GB card's memory held; FRAMES, BUDGET), budget (--gpu-memory 16GiB on
#               the whole GPU), sms (the spare's SM share A/B; SMS_RUNS row:share, LIMIT_S 570); then the
#               spare's GPU tests (TESTS, TEST_K "spare or lookahead"; TESTS="" skips)
#   kernel      the range kernel, PARTS (default variants): variants (loop variants, HEIGHTS), profile (a
#               step's kernels at PROFILE heights), ncu (Nsight Compute at NCU_HEIGHT, stages at
#               STAGES_HEIGHTS): $OUT/variants.json, profile/, ncu_N.txt, stages.json
#   probe       one probe: `probe NAME [options]` runs scripts/probes/NAME.py: $OUT/NAME.log
#   loops       loop closure off then on, one process (bench_loop_closure.py, FRAMES 3000); arguments: its
#               options: $OUT/loop_closure.json
#   maps        maps that outlive a run, PARTS in order (default run refine), each a call of its own on a machine
#               kept warm: run (FRAMES (10000) frames of the revisiting 640x480 video, flow keyframes, loop
#               closure on, MODEL (lingbot-map); the run kept in .carry-runs/, which the machine keeps between
#               calls), refine (a copy of the kept run refined, timed: $OUT/refine.json; BASE_TAR: another
#               tree's refine alternating with this one's ROUNDS times, refine_{other,this}_N.json), stop (one SIGTERM at
#               STOP_AT (30) s into each of a refine of a copy and `stream-recon run VIDEO --map` the kept run,
#               with a checkpoint of MODEL written first: seconds to exit, and whether the refined copy stayed
#               whole: $OUT/stop.log)
#   repro       loop closure's never-hang cell: the revisiting 640x480 video, flow keyframes, 1,000 frames
#   soak-a      never-hang cells: oxford, university; bench_e2e's at 518x518 (flow, all); 10,000 frames on
#   soak-b      never-hang cells: loop, courthouse; bench_e2e's at 518x392; 10,000 frames off
#   soak-c      never-hang cells: bench_e2e's at 518x294, 518x378 (all: 3,000 frames), 518x518 interval:3
#   long        one never-hang cell of 10,000 frames, flow keyframes, loop closure on
#   revisits    loop closure on revisit-heavy videos of the `loop` fixture (tests/data/loop), PARTS in order
#               (default walk tour): walk (a seeded random walk, 2,000 frames at 518x392: flow off and on,
#               all on, or ALL_MODES), tour (two laps, 1,500 frames at 518x518: TOUR_KEYFRAMES, flow off and on, all as walk),
#               long (the walk, 10,000 frames at 518x392, LONG_KEYFRAMES all, LONG_MODES on; one cell takes
#               ~6 min; SPLIT_MODES=1: each mode on a GPU of its own), graph (scripts/bench_pose_graph.py --stream GRAPH_SIZES
#               on this host's CPU): $OUT/revisits.log, revisits_NAME.json, pose_graph.log
#   sky         --mask-sky's cost: bench_e2e.py runs without it, then with the network placed as each of
#               SKY_VARIANTS (product fp32 fp32+whole fp32+sms16: scripts/probes/sky_placement.py), on the stand-in
#               network (SKY_GFLOPS 120), ROUNDS (2) times in turn; FRAMES 600, SIZE 640x480: $OUT/sky.log,
#               sky_NAME_N.json
# Carry: .whl (FlashInfer, viser and their needs) for every suite but the loop-closure ones (and maps), which carry
# .carry-gtsam/ (the wheels of plyfile, threadpoolctl and FlashInfer, gtsam-py312.tar.xz) and, for the scene cells,
# .carry-soak/SCENE.mp4 (an example scene of the official repository as a video); sky .carry-ort/ (the
# onnxruntime-gpu wheel in parts of a call's size, part-*, and its SHA-256 in wheel.sha256: carried one
# part a call to a machine kept warm, all of them there by the sky call, and plyfile's wheel);
# reference also
# .reference/lingbot-map (the official gct_profile.py and lingbot_map/); against the other tree (OTHER) or
# BASE_TAR.
# $OUT (default /tmp/out) gets gpu.txt and each suite's files above; the never-hang cells write every cell's
# JSON as a line of $OUT/soak.jsonl and its table lines to $OUT/soak.log; acceptance and spare's sms part pack
# all of $OUT into $OUT/out.tar.gz at the end.
set -uo pipefail
began=$(date +%s)
SUITE=${1:-}
shift || true
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | cut -c3- >&2; exit 2; }
grep -q "^#   ${SUITE:-?}  " "$0" || usage  # a suite this comment lists, or the comment
source scripts/device/env.sh
left() { echo $(( $1 - ($(date +%s) - began) )); }
wanted() { [[ " $1 " == *" $2 "* ]]; }  # wanted "LIST" WORD: WORD is one of LIST's words

# -- the product path --------------------------------------------------------------------------------------
suite_acceptance() {
  write_bytecode
  write_full_size_checkpoint
  python3 -c "import torch; torch.load('/tmp/ckpt/full-size.pt', mmap=True, weights_only=True)" 2>&1 | grep -v Warn
  export TORCHINDUCTOR_CACHE_DIR=/tmp/machine_A TRITON_CACHE_DIR=/tmp/machine_A/triton
  rm -rf /tmp/machine_A
  local rows=${ROWS:-first dense sparse all fit16 portrait} limit=${LIMIT_S:-540}
  row() { local name=$1 needs=$2; shift 2
    wanted "$rows" "$name" || return 0
    if [ "$(left "$limit")" -lt "$needs" ]; then echo "== $name: skipped, $(left "$limit") s left"; return; fi
    echo "== $name ($(( $(date +%s) - began )) s): $*"
    timeout "$needs" python3 scripts/bench_e2e.py --video-dir /tmp --checkpoint /tmp/ckpt/full-size.pt --viewer \
      --client "$@" ${ROW_ARGS:-} --log "$OUT/$name.stream.log" --json "$OUT/e2e_$name.json" > "$OUT/$name.log" 2>&1
    echo "   rc=$?"; grep -E "Error|error:" "$OUT/$name.log" | grep -v Warn | head -3; }
  row first 150 --frames 300 --video-size 640x480 --no-engine-run --compile auto
  wait_for_idle_gpu 120  # the compile child fills machine_A's caches for the compiled rows
  row dense 110 --frames 1000 --video-size 640x480 --no-engine-run --keyframes flow --flow-threshold 4
  row sparse 110 --frames 1000 --video-size 640x480 --no-engine-run --keyframes flow --flow-threshold 1e9 --max-gap 3
  row all 150 --frames 1000 --video-size 640x480
  if wanted "$rows" fit16 && [ "$(left "$limit")" -gt 120 ]; then
    wait_for_idle_gpu 60
    hold_all_but 16376
    row fit16 110 --frames 1000 --video-size 640x480 --no-engine-run --compile off --keyframes flow --flow-threshold 4
    kill "$HOG"; wait "$HOG" 2>/dev/null
  fi
  row portrait 170 --frames 1000 --video-size 720x1280
  run_gpu_tests "$began"
  summarize_rows keyframes steady_fps p50_ms p99_ms run_json_fps engine_steady_fps product_over_engine \
    peak_gpu_gib peak_gpu_reserved_gib rollovers rollovers_ahead provisional_frames rollover_longest_ms \
    rollover_longest_frame longest_interval_after_first_prediction_ms first_prediction_from_process_start_s \
    prediction_100_from_process_start_s video_made_s compile_beside
  pack_out
}

suite_e2e() {
  # a fresh process on a fresh machine first: its first prediction is the cold start (no compile caches)
  e2e cold --frames 200 --no-engine-run "$@"
  e2e all --frames 1000 --viewer --client --sink-costs "$@"
  e2e flow --frames 1000 --keyframes flow --flow-threshold 1e9 --max-gap 3 --viewer --client "$@"
}

suite_shapes_e2e() {
  python3 scripts/bench_e2e.py --video-dir /tmp --frames 1000 --video-size 1280x720,640x468,640x480,720x1280 \
    --viewer --client $([ "${WITH_ENGINE:-0}" = 1 ] || echo --no-engine-run) --json "$OUT/shapes_e2e.json" "$@" 2>&1 \
    | grep -v Warn | tail -40
}

# -- the engine --------------------------------------------------------------------------------------------
# Helper processes compile every size's blocks and heads while the sweep's process builds its model and the
# GPU tests (TESTS, TEST_K) run; then the sweep (for DEADLINE seconds).
# AFTER=FILE: the sweep waits for FILE too (a caller's own GPU work, run beside the compile helpers).
suite_shapes() {
  local limit=${LIMIT_S:-580} heights=${HEIGHTS:-280:518:14} workers=${WORKERS:-4} sweep i
  rm -f /tmp/gpu_free
  python3 scripts/bench_shapes.py --heights "$heights" --profile "${PROFILE:-}" --frames "${FRAMES:-40}" \
    --deadline-s "${DEADLINE:-400}" --variants "${VARIANTS:-balanced,frames}" --more "${MORE:-}" \
    --json "$OUT/shapes.json" --wait-for /tmp/gpu_free > "$OUT/shapes.log" 2>&1 &
  sweep=$!
  for i in $(seq 0 $((workers - 1))); do
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=4 python3 scripts/bench_shapes.py --compile-only \
      --heights "$heights" --share "$i/$workers" >> "$OUT/compile.log" 2>&1 &
  done
  if [ -n "${TESTS:-}" ]; then
    echo "== GPU tests: $TESTS -k '${TEST_K:-}'"
    timeout "${TEST_TIMEOUT:-260}" python3 -m pytest -q -s -p no:cacheprovider --durations=30 $TESTS -k "${TEST_K:-}" 2>&1 \
      | tee "$OUT/tests.log" | grep -E "vs golden|vs eager|sigma|passed|failed|Error|error|FAILED|PASSED|^E |s call" | tail -60
  fi
  while [ "$(jobs -rp | grep -vc "^$sweep$")" -gt 0 ]; do sleep 1; done  # the compile helpers
  while [ -n "${AFTER:-}" ] && [ ! -e "$AFTER" ]; do sleep 1; done  # whatever else the caller runs on the GPU
  grep -E "compiled|Error|error" "$OUT/compile.log" | tail -30
  echo "== sweep from $(( $(date +%s) - began )) s"
  touch /tmp/gpu_free  # the sweep (its model built meanwhile) measures from now, until DEADLINE
  wait "$sweep"
  grep -v -E "Warn|warn" "$OUT/shapes.log" | tail -40
}

suite_reference() {
  local height limit=${LIMIT_S:-585}
  for height in ${HEIGHTS:-378 392}; do
    echo "== 518x$height ($(( $(date +%s) - began )) s)"
    timeout 200 python3 scripts/bench.py --frames 80 --height "$height" --reference .reference/lingbot-map \
      --json "$OUT/reference_$height.json" 2>&1 | grep -v Warn | tail -12
  done
  echo "== GPU tests ($(( $(date +%s) - began )) s, $(left "$limit") s left)"
  timeout "$(left "$limit")" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_path.py \
    -k "${TEST_K:-gluon or golden or official_outputs or graph_replay}" 2>&1 | tail -15
}

suite_engine() {
  echo "== engine: $*" | tee -a "$OUT/engine.log"
  python3 scripts/bench.py "$@" --json "$OUT/engine.json" 2>&1 | grep -v Warn | tee -a "$OUT/engine.log"
}

# Both trees' benches from their own roots, each importing its own package, so that a tree from before the
# scripts moved runs as it did then.
suite_against() {
  local other round side root package e2e_args="--frames 300 --no-engine-run"
  [ -n "${E2E_ARGS:-}" ] && e2e_args=$E2E_ARGS
  if [ -n "${BASE_TAR:-}" ]; then
    other=/tmp/base; mkdir -p "$other"; tar -xf "$BASE_TAR" -C "$other"
  else
    other=$(cd "${OTHER:?name the other tree in OTHER (a folder) or BASE_TAR (a tar)}" && pwd)
  fi
  link_package sr_other "$other"
  if [ -n "${CHECKPOINT:-}" ]; then  # both trees load one checkpoint file, read once first (page cache warm)
    checkpoint_once
    python3 -c "import torch; torch.load('/tmp/ckpt/full-size.pt', mmap=True, weights_only=True)" 2>&1 | grep -v Warn
    e2e_args="$e2e_args --checkpoint /tmp/ckpt/full-size.pt"
  fi
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for side in ${ORDER:-other this}; do
      if [ "$side" = this ]; then root=$PWD package=/tmp/sr; else root=$other package=/tmp/sr_other; fi
      if wanted "${WHAT:-engine}" engine; then
        echo "== engine, round $round, $side: $*" | tee -a "$OUT/against.log"
        (cd "$root" && PYTHONPATH=$package:/tmp/site python3 scripts/bench.py "$@" \
          --json "$OUT/engine_${side}_$round.json" 2>&1 | grep -v Warn \
          | grep -E "ms_per_frame|fps|peak|cold_start|attention|graphs|Error|error|Traceback" | tee -a "$OUT/against.log")
      fi
      if wanted "${WHAT:-engine}" product; then
        echo "== product, round $round, $side: $e2e_args" | tee -a "$OUT/against.log"
        (cd "$root" && PYTHONPATH=$package:/tmp/site timeout 300 python3 scripts/bench_e2e.py --video-dir /tmp \
          $e2e_args --json "$OUT/product_${side}_$round.json" 2>&1 | grep -v Warn \
          | tail -25 | tee -a "$OUT/against.log")
      fi
    done
  done
}

suite_gpu_tests() {
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>/dev/null | tee -a "$OUT/gpu.txt"
  python3 -m pytest -q -s -p no:cacheprovider --durations=20 ${TESTS:-tests/test_gpu_fast_path.py tests/test_gpu_flashinfer.py} \
    "$@" 2>&1 | tee "$OUT/gpu_tests.log" \
    | grep -E "vs golden|vs eager|sigma|passed|failed|Error|error|FAILED|PASSED|^E |s call" | tail -80
}

# -- a fresh machine's start -------------------------------------------------------------------------------
bytecode_written=0
bytecode_once() { [ "$bytecode_written" = 1 ] || { write_bytecode; bytecode_written=1; }; }
checkpoint_written=0
checkpoint_once() { [ "$checkpoint_written" = 1 ] || { write_full_size_checkpoint; checkpoint_written=1; }; }
# cold_probe LOG NAME CACHE_DIR [probe_cold_start options]: one process on its own compile caches
cold_probe() { local log=$1 name=$2 dir=$3; shift 3; echo "== $name" | tee -a "$OUT/$log"
  TORCHINDUCTOR_CACHE_DIR=$dir TRITON_CACHE_DIR=$dir/triton timeout 300 python3 scripts/probes/probe_cold_start.py \
    --height "${HEIGHT:-392}" "$@" 2>&1 | grep -v Warn | tail -3 | tee -a "$OUT/$log"; }

# From the command's start to the 100th prediction, --compile auto on compile caches that start empty
# ("machines"), a 4.6 GB checkpoint loaded inside the run, 640x480 (518x392), viewer with a client. OLD=folder
# or TREES="name:folder ..." (trees of app/ models/ cache/ configs/ of other commits) alternate with this
# tree, each on caches of its own, ROUNDS times; this tree's bench_e2e.py measures every row. E2E_ARGS: more
# options for every row (--timeline: what the main thread ran until the 100th prediction).
start_first() {
  local trees="${TREES:-}${OLD:+ old:$OLD}" tree round
  bytecode_once
  checkpoint_once
  # one throwaway process reads torch and the checkpoint first, so no row pays for the cold disk alone
  python3 -c "import torch; torch.load('/tmp/ckpt/full-size.pt', mmap=True, weights_only=True)" 2>&1 | grep -v Warn
  for tree in $trees; do link_package "sr_${tree%%:*}" "${tree#*:}"; done
  first_run() { local name=$1 path=$2; shift 2
    rm -rf "/tmp/machine_$name"; mkdir -p "/tmp/machine_$name"
    echo "== $name: $*" | tee -a "$OUT/e2e.log"
    TORCHINDUCTOR_CACHE_DIR=/tmp/machine_$name TRITON_CACHE_DIR=/tmp/machine_$name/triton PYTHONPATH=$path:/tmp/site \
      timeout 200 python3 scripts/bench_e2e.py --video-dir /tmp --checkpoint /tmp/ckpt/full-size.pt \
      --frames "${FRAMES:-400}" --video-size 640x480 --viewer --client --no-engine-run --compile auto \
      --json "$OUT/e2e_$name.json" ${E2E_ARGS:-} "$@" 2>&1 | grep -v Warn | tail -30 | tee -a "$OUT/e2e.log"
    sleep "${CHILD_WAIT:-20}"  # the run's compile child finishes beside nothing of the next row
  }
  for round in $(seq "${ROUNDS:-1}"); do
    first_run "new_$round" /tmp/sr
    for tree in $trees; do first_run "${tree%%:*}_$round" "/tmp/sr_${tree%%:*}"; done
  done
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("e2e_*.json")):
    row = json.loads(path.read_text())
    keys = ("first_prediction_s", "first_prediction_from_process_start_s", "prediction_100_from_process_start_s",
            "run_model_load_s", "run_warm_up_s", "run_warm_up_parts_s", "longest_interval_after_first_prediction_ms",
            "steady_fps", "run_json_fps")
    print(path.stem, {k: row.get(k) for k in keys if k in row})
    timeline = row.get("timeline", {})
    for thread in ("MainThread", "kernel-build-ahead"):
        for segment in timeline.get(thread, []):
            print(f"  {thread[:6]} {segment['at_s']:6.2f} s  {segment['s']:5.2f} s  {segment['ours']:40s} "
                  f"{segment['innermost']}")
    if timeline.get("building_threads_s"):
        print("  building threads:", timeline["building_threads_s"])
PY
}

# The start of a run on empty compile caches (the size's first run, its compile child beside it) and on warm ones
# (the next run, compiled from what that child left), at each video size of SIZES (640x480 makes 518x392 model
# input, 480x480 518x518), of this tree and of each of TREES ("name:folder"), one process a run, every output
# written. A tree's runs share caches of their own that start empty: $OUT/e2e_TREE_SIZE_{empty,warm}.json.
# ROUNDS (1) above 1: TREES alternate that many times a size, this tree only in the first round (the call's first
# run pays ~1 s more), $OUT/e2e_TREE_SIZE_RUN_rN.json, and each tree's median first prediction is printed: one
# run's first prediction spreads ±20 %, more than a ±5 % comparison can rest on.
start_warm() {
  local size tree name path run round trees suffix
  bytecode_once
  checkpoint_once
  python3 -c "import torch; torch.load('/tmp/ckpt/full-size.pt', mmap=True, weights_only=True)" 2>&1 | grep -v Warn
  for tree in ${TREES:-}; do link_package "sr_${tree%%:*}" "${tree#*:}"; done
  for size in ${SIZES:-640x480 480x480}; do
   for round in $(seq "${ROUNDS:-1}"); do
    trees="${TREES:-}"; [ "$round" = 1 ] && trees="this:$PWD $trees"
    suffix=""; [ "${ROUNDS:-1}" = 1 ] || suffix="_r$round"
    for tree in $trees; do
      name=${tree%%:*}; path=/tmp/sr_$name; [ "$name" = this ] && path=/tmp/sr
      rm -rf /tmp/machine_w; mkdir -p /tmp/machine_w
      for run in empty warm; do
        echo "== $name $size $run ($(( $(date +%s) - began )) s)" | tee -a "$OUT/e2e.log"
        # each tree's own bench from its own root: a tree from before the app's rooms imports its own modules
        (cd "${tree#*:}" && TORCHINDUCTOR_CACHE_DIR=/tmp/machine_w TRITON_CACHE_DIR=/tmp/machine_w/triton \
          PYTHONPATH=$path:/tmp/site timeout 200 python3 scripts/bench_e2e.py --video-dir /tmp \
          --checkpoint /tmp/ckpt/full-size.pt \
          --frames "${FRAMES:-400}" --video-size "$size" --no-engine-run --compile auto ${E2E_ARGS:-} \
          --json "$OUT/e2e_${name}_${size}_$run$suffix.json" 2>&1 | grep -v Warn | tail -3 >> "$OUT/e2e.log")
        [ "$run" = empty ] || continue
        for _ in $(seq 240); do ls /tmp/machine_w/stream-recon-compiled/*.compiled >/dev/null 2>&1 && break; sleep 0.5; done
        wait_for_idle_gpu 60  # the compile child has left the GPU
      done
    done
   done
  done
  python3 - "$OUT" <<'PY'
import json, pathlib, statistics, sys
keys = ("first_prediction_s", "run_model_load_s", "prediction_100_s", "run_warm_up_s", "steady_fps", "run_json_fps",
        "compiled_while_streaming", "steady_fps_compiled",
        "longest_interval_after_first_prediction_ms", "first_prediction_from_process_start_s")
for path in sorted(pathlib.Path(sys.argv[1]).glob("e2e_*_*_*.json")):
    row = json.loads(path.read_text())
    print(path.stem, {k: (round(row[k], 2) if isinstance(row.get(k), float) else row.get(k)) for k in keys},
          "warm-up parts", row.get("run_warm_up_parts_s"))
firsts = {}
for path in pathlib.Path(sys.argv[1]).glob("e2e_*_*_*_r*.json"):
    tree_size_run = path.stem.rsplit("_r", 1)[0]
    firsts.setdefault(tree_size_run, []).append(json.loads(path.read_text())["first_prediction_s"])
for key, values in sorted(firsts.items()):
    print("median first prediction", key, round(statistics.median(values), 2), "of", sorted(round(v, 2) for v in values))
PY
}

# Imports timed before and after the installed packages' bytecode is written (so list it first), then the
# cold-start probe on empty caches listing every Triton kernel built, then the range kernel's builds one
# after another and on threads.
start_imports() {
  local threads started
  imports() { local what; for what in "import torch" "import torch, torch._dynamo, torch._inductor.compile_fx"; do
    python3 -c "import time; t = time.perf_counter(); $what; print('$1', repr('$what'), round(time.perf_counter() - t, 2))"
    done | tee -a "$OUT/imports.log"; }
  imports no_bytecode
  started=$SECONDS
  bytecode_once
  echo "bytecode written in $((SECONDS - started)) s" | tee -a "$OUT/imports.log"
  imports bytecode
  imports bytecode_again
  cold_probe cold.log eager_cold /tmp/first_eager --triton-builds --no-compile
  cold_probe cold.log eager_warm /tmp/first_eager --triton-builds --no-compile
  cold_probe cold.log compiled_cold /tmp/first_compiled --triton-builds
  for threads in 1 8; do
    TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/probes/probe_triton_builds.py --threads "$threads" 2>&1 | grep -v Warn \
      | tail -2 | tee -a "$OUT/cold.log"
  done
}

# Compiled on empty caches, again on the caches it filled, uncompiled on empty caches and again, compiled on
# empty caches with one compile thread; each row pair on caches of its own.
start_cold() {
  cold_probe cold.log compiled_cold /tmp/cold_compiled
  cold_probe cold.log compiled_warm /tmp/cold_compiled
  cold_probe cold.log eager_cold /tmp/cold_eager --no-compile
  cold_probe cold.log eager_warm /tmp/cold_eager --no-compile
  TORCHINDUCTOR_COMPILE_THREADS=1 cold_probe cold.log compiled_cold_one_thread /tmp/cold_serial
}

# --compile auto against on: machine A a first run with auto (uncompiled, a child compiles the size), the
# child's record, a second run; machine B a first run with on. 1,000 frames of 640x480, the checkpoint file
# loaded inside the run. BYTECODE=0 skips the bytecode; E2E_EXTRA adds bench_e2e options.
start_compile() {
  local ended
  [[ ${BYTECODE:-1} == 1 ]] && bytecode_once
  checkpoint_once
  machine() { rm -rf "/tmp/machine_$1"; mkdir -p "/tmp/machine_$1"
    export TORCHINDUCTOR_CACHE_DIR=/tmp/machine_$1 TRITON_CACHE_DIR=/tmp/machine_$1/triton; }
  compile_run() { local name=$1; shift
    e2e "$name" --checkpoint /tmp/ckpt/full-size.pt --frames 1000 --video-size 640x480 --viewer --client \
      --no-engine-run ${E2E_EXTRA:-} "$@"; }
  machine A
  compile_run auto_first --compile auto
  ended=$SECONDS
  for _ in $(seq 240); do ls /tmp/machine_A/stream-recon-compiled/*.compiled >/dev/null 2>&1 && break; sleep 0.5; done
  echo "== the child's record $((SECONDS - ended)) s after the first run ended:" | tee -a "$OUT/e2e.log"
  cat /tmp/machine_A/stream-recon-compiled/*.compiled 2>&1 | tee -a "$OUT/e2e.log"
  tail -5 /tmp/machine_A/stream-recon-compiled/*.log 2>&1 | grep -v Warn | tee -a "$OUT/e2e.log"
  compile_run auto_second --compile auto
  machine B
  compile_run on_first --compile on
  unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR
}

# The warm-up's dry pass: uncompiled, each pair of rows on caches of its own that start empty, with the dry
# pass (on empty caches, then on those it filled) and without (--no-dry-builds); ORDER: "dry plain".
start_builds() {
  local order
  bytecode_once
  python3 -c "import torch, triton; torch.zeros(1, device='cuda')" 2>&1 | grep -v Warn
  for order in ${ORDER:-dry plain}; do
    if [[ $order == dry ]]; then
      cold_probe builds.log dry_cold /tmp/builds_dry --no-compile --triton-builds --frames 60 --timed 40
      cold_probe builds.log dry_warm /tmp/builds_dry --no-compile --triton-builds --frames 60 --timed 40
    else
      cold_probe builds.log plain_cold /tmp/builds_plain --no-compile --triton-builds --frames 60 --timed 40 --no-dry-builds
      cold_probe builds.log plain_warm /tmp/builds_plain --no-compile --triton-builds --frames 60 --timed 40 --no-dry-builds
    fi
  done
}

# The warm-up before the stream: one process per WARM_UP_RUNS entry name:auto|on|off, the first on a fresh
# machine's empty caches; 1,000 frames of VIDEO_SIZE (640x480), viewer with a client.
start_warm_up() {
  local spec
  for spec in ${WARM_UP_RUNS:-fresh:auto warm:auto off:off warm2:auto}; do
    e2e "${spec%%:*}" --frames 1000 --video-size "${VIDEO_SIZE:-640x480}" --viewer --client --no-engine-run \
      --warm-up "${spec#*:}" ${E2E_EXTRA:-}
  done
}

# Compiled code kept between runs: one process per KEPT_RUNS entry mode:name (kept: artefacts under
# ~/.cache/stream-recon/compiled, the first run compiles and keeps them; usual: STREAM_RECON_COMPILED="").
start_kept() {
  local spec mode name
  for spec in ${KEPT_RUNS:-kept:first kept:second kept:third}; do
    mode=${spec%%:*}; name=${spec#*:}
    if [[ $mode == usual ]]; then export STREAM_RECON_COMPILED=""; else unset STREAM_RECON_COMPILED; fi
    e2e "$name" --frames 1000 --video-size "${VIDEO_SIZE:-640x480}" --viewer --client --no-engine-run ${E2E_EXTRA:-}
  done
  unset STREAM_RECON_COMPILED
  du -sh ~/.cache/stream-recon/compiled | tee -a "$OUT/e2e.log"
  find ~/.cache/stream-recon/compiled -name '*.pt' | wc -l | tee -a "$OUT/e2e.log"
}

suite_start() {
  local part
  for part in ${PARTS:-first}; do
    case "$part" in
      first) start_first ;;
      imports) start_imports ;;
      cold) start_cold ;;
      compile) start_compile ;;
      builds) start_builds ;;
      warm-up) start_warm_up ;;
      kept) start_kept ;;
      warm) start_warm ;;
      *) echo "start: no part $part (first imports cold compile builds warm-up kept warm)" >&2; exit 2 ;;
    esac
  done
  run_gpu_tests "$began"
}

# -- the spare engine and rollovers --------------------------------------------------------------------------
FLOW_DENSE="--keyframes flow --flow-threshold 4"
FLOW_SPARSE="--keyframes flow --flow-threshold 1e9 --max-gap 3"

# Flow keyframes on a keyframe-dense video (DENSE_THRESHOLD) and a keyframe-sparse one, and keyframes all:
# 1,000 frames of 640x480, every output written, viewer with a client, one process each.
spare_rows() {
  local common="--frames 1000 --video-size 640x480 --viewer --client --no-engine-run"
  e2e flow_dense $common --keyframes flow --flow-threshold "${DENSE_THRESHOLD:-4}"
  e2e flow_sparse $common $FLOW_SPARSE
  e2e all $common
}

# Rollover traces (scripts/probes/trace_rollover.py) of keyframes all and sparse flow; the arguments go to
# the traces (e.g. --pace 1.8, --main-priority 0).
spare_traces() {
  trace() { local name=$1; shift; echo "== trace $name: $*" | tee -a "$OUT/e2e.log"
    timeout 200 python3 scripts/probes/trace_rollover.py --video-dir /tmp --viewer --client --no-engine-run "$@" \
      --json "/tmp/trace_$name.json" 2>&1 | grep -v Warn > "$OUT/trace_$name.log"
    grep -E "stall|steady FPS" "$OUT/trace_$name.log" | tee -a "$OUT/e2e.log"; }
  trace all --frames 700 --trace-before 0.6 --trace-after 0.5 "$@"
  trace flow --frames 1000 $FLOW_SPARSE --trace-after 1.5 "$@"
}

# A second process holds all but 16,376 MiB of the GPU (what a 16 GB card reports in all); the product path at
# 518x392 with keyframes all, then dense flow, the lookahead left to auto (BUDGET=16GiB: a flow run under
# --gpu-memory too); each run's engine log (the spare's room, rollovers, out-of-memory warnings) in
# $OUT/NAME.stream.log.
spare_fit16() {
  # no other process on the GPU (an earlier run's compile child, say): what it frees later would be free
  # beside the run, more than a 16 GB card has
  wait_for_idle_gpu 120
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | sed 's/^/still on the GPU: /'
  hold_all_but 16376
  nvidia-smi --query-gpu=memory.used,memory.free --format=csv
  fit_run() { local name=$1; shift
    python3 scripts/bench_e2e.py --video-dir /tmp --frames "${FRAMES:-1000}" --video-size 640x480 --viewer --client \
      --no-engine-run "$@" --log "$OUT/$name.stream.log" --json "$OUT/e2e_$name.json" > "$OUT/$name.log" 2>&1
    echo "== $name rc=$?"
    grep -i "OutOfMemory\|Error\|memory plan" "$OUT/$name.log" | grep -v Warn | cut -c1-400 | head -3
    grep -i "ahead of rollovers\|out of device memory" "$OUT/$name.stream.log" | cut -c1-400 | head -4; }
  fit_run fit16all
  fit_run fit16flow $FLOW_DENSE
  [ -n "${BUDGET:-}" ] && fit_run fit16budget $FLOW_DENSE --gpu-memory "$BUDGET"
  kill "$HOG"; wait "$HOG" 2>/dev/null
  summarize_rows steady_fps p50_ms p99_ms run_json_fps peak_gpu_gib peak_gpu_reserved_gib rollovers rollovers_ahead \
    provisional_frames lookahead_starts rollover_longest_ms rollover_longest_frame longest_stall_ms keyframes \
    compile_beside prediction_100_from_process_start_s
}

# The spare's provisional room fitted to a budget on the whole GPU: flow keyframes under --gpu-memory 16GiB.
spare_budget() {
  e2e flow_16gib --frames 1000 --video-size 640x480 --viewer --client --no-engine-run --keyframes flow \
    --gpu-memory 16GiB
}

# The share of the SMs the spare's own kernels may use (SPARE_SM_SHARE; 1: every SM), flow keyframes, 1,000
# frames 640x480, the checkpoint file loaded in the run, each run one process of trace_rollover.py, the shares
# alternating. SMS_RUNS lists row:share; rows: dense, sparse (compiled), uncompiled (dense, --compile off),
# fit16 (uncompiled beside a process holding all but a 16 GB card's memory), all (keyframes all, compiled).
spare_sms() {
  local item row way name needs key number=0 limit=${LIMIT_S:-570}
  local -A options=([dense]="--flow-threshold 4 --compile on" [sparse]="--flow-threshold 1e9 --max-gap 3 --compile on"
                    [uncompiled]="--flow-threshold 4 --compile off" [fit16]="--flow-threshold 4 --compile off"
                    [all]="--keyframes all --compile on")
  local -A compiled=()  # the compile keys compiled so far in this call: flow, all
  checkpoint_once
  export TORCHINDUCTOR_CACHE_DIR=/tmp/machine_A TRITON_CACHE_DIR=/tmp/machine_A/triton
  for item in ${SMS_RUNS:-dense:1 dense:0.6 sparse:0.6 sparse:1 uncompiled:1 uncompiled:0.6}; do
    row=${item%%:*} way=${item#*:} number=$((number + 1)) needs=90
    key=$([ "$row" = all ] && echo all || echo flow)
    if [[ "${options[$row]}" == *"--compile on"* && -z "${compiled[$key]:-}" ]]; then
      needs=150 compiled[$key]=1  # the first run of a compile key compiles the size
    fi
    name="${number}_${row}_${way}"
    if [ "$(left "$limit")" -lt "$needs" ]; then echo "== $name: skipped, $(left "$limit") s left"; continue; fi
    [ "$row" = fit16 ] && { wait_for_idle_gpu 60; hold_all_but 16376; }
    echo "== $name ($(( $(date +%s) - began )) s)"
    timeout "$needs" python3 scripts/probes/trace_rollover.py --longest 3 --trace-before 0.05 --trace-after 0.3 \
      --spare-sm-share "$way" --video-dir /tmp --checkpoint /tmp/ckpt/full-size.pt --viewer --client --frames 1000 \
      --video-size 640x480 --no-engine-run --keyframes flow ${options[$row]} --json "$OUT/e2e_$name.json" \
      > "$OUT/$name.log" 2>&1
    echo "   rc=$?"; grep -E "Error|error:" "$OUT/$name.log" | grep -v Warn | head -3
    [ "$row" = fit16 ] && { kill "$HOG"; wait "$HOG" 2>/dev/null; }
  done
  unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR
  summarize_rows keyframes steady_fps p50_ms rollovers rollovers_ahead provisional_frames \
    rollover_longest_ms rollover_longest_frame rollover_regions
}

suite_spare() {
  local part
  for part in ${PARTS:-rows}; do
    case "$part" in
      rows) spare_rows ;;
      traces) spare_traces "$@" ;;
      fit16) spare_fit16 ;;
      budget) spare_budget ;;
      sms) spare_sms ;;
      *) echo "spare: no part $part (rows traces fit16 budget sms)" >&2; exit 2 ;;
    esac
  done
  TESTS=${TESTS-tests/test_gpu_fast_path.py} TEST_K=${TEST_K-spare or lookahead} run_gpu_tests "$began"
  if wanted "${PARTS:-rows}" sms; then pack_out; fi
}

# -- the range kernel ----------------------------------------------------------------------------------------
suite_kernel() {
  local part skip sections
  for part in ${PARTS:-variants}; do
    case "$part" in
      variants)
        timeout "${PROBE_TIMEOUT:-240}" python3 scripts/probes/probe_range_variants.py --heights "${HEIGHTS:-378,392,518,322}" \
          --json "$OUT/variants.json" 2>&1 | grep -v Warn | tee "$OUT/variants.log" ;;
      profile)
        timeout "${PROFILE_TIMEOUT:-300}" python3 scripts/probes/profile_step.py --no-graphs --height "${PROFILE:-392,518}" \
          --frames 4 --out "$OUT/profile" 2>&1 | grep -v Warn | tee "$OUT/profile.log" | head -80 ;;
      ncu)
        sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section InstructionStats --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats"
        for skip in 2 5; do  # the third launch of each configuration (3 stages, then 2)
          timeout 200 ncu --clock-control none -k regex:_range_attention_kernel --launch-skip $skip --launch-count 1 $sections \
            python3 scripts/probes/probe_range_variants.py --ncu "${NCU_HEIGHT:-378}" > "$OUT/ncu_$skip.txt" 2>&1
          grep -E "Duration|Issue|Issued|Executed Ipc|Pipe|Stall|Registers|Shared Memory Config|Block Limit|Achieved Occupancy|Theoretical Occupancy|Warp Cycles|No Eligible|Active Warps|Eligible Warps|SM Busy|Compute \(SM\)|Memory Throughput|ERR|rror" "$OUT/ncu_$skip.txt" | head -45
        done
        timeout "${PROBE_TIMEOUT:-300}" python3 scripts/probes/probe_range_variants.py \
          --stages-heights "${STAGES_HEIGHTS:-378,392,518}" --json "$OUT/stages.json" 2>&1 | grep -v Warn | tail -12 ;;
      *) echo "kernel: no part $part (variants profile ncu)" >&2; exit 2 ;;
    esac
  done
}

suite_probe() {
  local name=${1:-}; shift || true
  [ -n "$name" ] && [ -f "scripts/probes/$name.py" ] || { echo "probe NAME: one of scripts/probes/*.py" >&2; exit 2; }
  python3 "scripts/probes/$name.py" "$@" 2>&1 | grep -v Warn | tee "$OUT/$name.log"
}

# -- loop closure ------------------------------------------------------------------------------------------
suite_loops() {
  python3 scripts/bench_loop_closure.py --frames "${FRAMES:-3000}" --json "$OUT/loop_closure.json" "$@"
}

# -- maps that outlive a run ------------------------------------------------------------------------------
kept_run() { du -s .carry-runs/bench_loop_closure_* 2>/dev/null | sort -n | tail -1 | cut -f2; }
stream_recon() { python3 -c 'import sys; from stream_recon.app.cli import main; main(sys.argv[1:])' "$@"; }
# stopped NAME COMMAND...: COMMAND started, one SIGTERM STOP_AT seconds later, the seconds to its exit in stop.log
stopped() { local name=$1 sent code; shift
  "$@" > "$OUT/stop_$name.log" 2>&1 & local pid=$!
  sleep "${STOP_AT:-30}"; sent=$(date +%s.%N); kill -TERM "$pid"; wait "$pid"; code=$?
  echo "$name: SIGTERM at ${STOP_AT:-30} s, exit $code $(python3 -c 'import sys, time; print(f"{time.time() - float(sys.argv[1]):.2f} s")' "$sent") after it" \
    | tee -a "$OUT/stop.log"; }
# refine_rounds RUN COPY: a copy of RUN refined by this tree, timed ($OUT/refine.json); with BASE_TAR (another
# tree's `git archive`), that tree's refine and this one's alternate ROUNDS (1) times on fresh copies, each from
# its own package ($OUT/refine_{other,this}_N.json), so that two trees compare on one machine.
refine_rounds() { local run=$1 copy=$2 round side package sides=this
  if [ -n "${BASE_TAR:-}" ]; then
    mkdir -p /tmp/base; tar -xf "$BASE_TAR" -C /tmp/base; link_package sr_other /tmp/base; sides="other this"
  fi
  for round in $(seq "${ROUNDS:-1}"); do
    for side in $sides; do
      package=/tmp/sr; [ "$side" = other ] && package=/tmp/sr_other
      rm -rf "$copy"; cp -r "$run" "$copy"; sync
      echo "== refine, round $round, $side" | tee -a "$OUT/refine.log"
      PYTHONPATH=$package:/tmp/site timeout "${LIMIT_S:-570}" python3 - "$copy" "$OUT/refine_${side}_$round.json" \
        <<'PY' 2>&1 | grep -v Warn | tee -a "$OUT/refine.log"
import json, sys
from pathlib import Path
sys.path.insert(0, "scripts")
from bench_loop_closure import print_refine, refined_run
refine = refined_run(Path(sys.argv[1]))
print_refine(refine)
Path(sys.argv[2]).write_text(json.dumps(refine, indent=2))
PY
    done
  done
  [ "$sides" = this ] && cp "$OUT/refine_this_1.json" "$OUT/refine.json"; return 0; }
suite_maps() { local part run copy
  for part in ${PARTS:-run refine}; do
    run=$(kept_run); copy=.carry-runs/copy
    case "$part" in
      run) mkdir -p .carry-runs; rm -rf .carry-runs/bench_loop_closure_* .carry-runs/copy .carry-runs/extended
           timeout "${LIMIT_S:-570}" python3 scripts/bench_loop_closure.py --frames "${FRAMES:-10000}" --modes on --keep \
             --keyframes flow --video-size 640x480 --warmup-frames 40 --compile off --model "${MODEL:-lingbot-map}" \
             --video-dir .carry-runs --log "$OUT/run.log" --json "$OUT/run.json" 2>&1 | grep --line-buffered -v Warn \
             | tee "$OUT/bench.log" ;;
      refine) refine_rounds "$run" "$copy" ;;
      stop) rm -rf "$copy" .carry-runs/extended; cp -r "$run" "$copy"
            stopped refine stream_recon refine "$copy"
            python3 - "$copy" <<'PY' | tee -a "$OUT/stop.log"
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
left = [path.name for path in run.iterdir() if path.name.startswith(".")]
refined = "refine" in json.loads((run / "run.json").read_text()).get("summary", {})
print(f"refine stopped: run.json refined {refined}, hidden folders left {left}")
PY
            MODEL_PRESET=${MODEL:-lingbot-map} checkpoint_once
            stopped map stream_recon "$(ls .carry-runs/bench_e2e_*.mp4 | head -1)" --map "$run" -o .carry-runs/extended \
              --checkpoint /tmp/ckpt/full-size.pt --keyframes flow --no-viewer --compile off --no-memory-check ;;
      *) echo "maps: no part $part (run refine stop)" >&2; exit 2 ;;
    esac
  done
}

# cell NAME KEYFRAMES VIDEO_SIZE FRAMES [SCENE] [MODES]: one process of scripts/bench_loop_closure.py (the
# product path with every output written, --loop-closure off then on), at most CELL_LIMIT_S seconds (a hang
# shows as a timeout, and its line says so). The soak's videos: bench_e2e's (the sample frames forwards and
# backwards while a crop pans) at each size and keyframe policy, and each scene played forwards and backwards
# at one size: a 640x480 video is read at 518x392, 640x468 at 518x378, 1280x720 at 518x294, 720x1280 at 518x518.
cell() { local name=$1 keyframes=$2 size=$3 frames=$4 scene=${5:--} modes=${6:-off,on} started scene_args=()
  started=$(date +%s)
  [ "$scene" != - ] && scene_args=(--scene ".carry-soak/$scene.mp4")
  mkdir -p "/tmp/videos_$name"
  timeout "${CELL_LIMIT_S:-560}" python3 scripts/bench_loop_closure.py --frames "$frames" --warmup-frames 40 \
    --video-size "$size" --keyframes "$keyframes" --compile "${COMPILE:-off}" --modes "$modes" \
    --video-dir "/tmp/videos_$name" "${scene_args[@]}" --json "/tmp/soak_$name.json" > "/tmp/soak_$name.log" 2>&1
  local status=$?
  { echo "== $name (GPU ${CUDA_VISIBLE_DEVICES:-0}): --keyframes $keyframes, $size video, scene $scene, $frames frames"
    grep -v Warn "/tmp/soak_$name.log" | grep -E "FPS|loop closure|Error|error|Traceback"
    echo "   exit $status after $(( $(date +%s) - started )) s"; } >> "$OUT/soak.log"
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); d.update(name=sys.argv[2], exit=int(sys.argv[3]),
gpu=sys.argv[4]); print(json.dumps(d))" "/tmp/soak_$name.json" "$name" "$status" "${CUDA_VISIBLE_DEVICES:-0}" \
    >> "$OUT/soak.jsonl" 2>/dev/null || echo "{\"name\": \"$name\", \"exit\": $status}" >> "$OUT/soak.jsonl"; }

# The next line of /tmp/soak.jobs that no GPU has taken, or nothing (status 1) when none is left.
take_job() { local taken line
  exec 9>>/tmp/soak.lock; flock 9
  taken=$(cat /tmp/soak.taken 2>/dev/null || echo 0)
  line=$(sed -n "$((taken + 1))p" /tmp/soak.jobs)
  echo $((taken + 1)) > /tmp/soak.taken
  flock -u 9; exec 9>&-
  [ -n "$line" ] && echo "$line"; }

# Every job on stdin (one cell's arguments a line, the longest first) on every GPU, each GPU taking the next
# job when it is free.
run_jobs() { local gpus gpu; cat > /tmp/soak.jobs; rm -f /tmp/soak.taken
  gpus=$(nvidia-smi -L | wc -l)
  for ((gpu = 0; gpu < gpus; gpu++)); do
    ( export CUDA_VISIBLE_DEVICES=$gpu; while line=$(take_job); do read -r -a job <<< "$line"; cell "${job[@]}"; done ) &
  done
  wait; cat "$OUT/soak.log"; }

# jobs SIZE SCENE FRAMES: the three keyframe policies on one video (SCENE - : bench_e2e's video)
jobs_of() { local label=${2/#-/synthetic} keyframes
  for keyframes in flow all interval:3; do echo "${label}_${keyframes/:/}_$1 $keyframes $1 $3 $2"; done; }

suite_never_hang() {
  local frames=${FRAMES:-2000}
  case "$1" in
    repro) cell repro_flow_392 flow 640x480 1000; cat "$OUT/soak.log" ;;
    soak-a) { echo "long_on flow 640x480 10000 - on"; jobs_of 720x1280 - "$frames" | grep -v interval
              jobs_of 640x480 oxford "$frames"; jobs_of 1280x720 university "$frames"; } | run_jobs ;;
    soak-b) { echo "long_off flow 640x480 10000 - off"; jobs_of 720x1280 courthouse "$frames"
              jobs_of 640x480 - "$frames"; jobs_of 640x468 loop "$frames"; } | run_jobs ;;
    soak-c) { jobs_of 720x1280 - "$frames" | grep interval; echo "synthetic_all_640x468 all 640x468 3000 -"
              jobs_of 640x468 - "$frames" | grep -v " all "; jobs_of 1280x720 - "$frames"; } | run_jobs ;;
    long) cell long_flow_392 flow 640x480 10000 - on; cat "$OUT/soak.log" ;;
  esac
}

# revisit NAME ORDER SIZE FRAMES KEYFRAMES MODES [SCENE]: one bench_loop_closure.py process on the scene's video;
# with SPLIT_MODES=1 on a machine of several GPUs, one process a mode, each on a GPU of its own, all at once
# (a mode's FPS then shares the host's CPU with the others: compare it with the same run's other mode).
revisit() { local name=$1 modes=$6 index=0 mode
  if [ "${SPLIT_MODES:-0}" = 1 ] && [ "$(nvidia-smi -L | wc -l)" -gt 1 ]; then
    for mode in ${modes//,/ }; do
      CUDA_VISIBLE_DEVICES=$index revisit_process "${name}_$mode" "$2" "$3" "$4" "$5" "$mode" "${7:-tests/data/loop}" \
        "/tmp/videos_$index" & index=$((index + 1))
    done; wait
  else revisit_process "$@"; fi; }
revisit_process() { local name=$1 order=$2 size=$3 frames=$4 keyframes=$5 modes=$6 scene=${7:-tests/data/loop} source=()
  local videos=${8:-/tmp}; mkdir -p "$videos"
  [ "$order" = - ] && source=() || source=(--scene "$scene" --order "$order")
  echo "== $name: $order, $size, $frames frames, --keyframes $keyframes, modes $modes, GPU ${CUDA_VISIBLE_DEVICES:-0} ($(( $(date +%s) - began )) s)" \
    | tee -a "$OUT/revisits.log"
  timeout "${CELL_LIMIT_S:-560}" python3 scripts/bench_loop_closure.py --frames "$frames" --warmup-frames 40 \
    --video-size "$size" --keyframes "$keyframes" --compile "${COMPILE:-off}" --modes "$modes" "${source[@]}" \
    --video-dir "$videos" --json "$OUT/revisits_$name.json" 2>&1 | grep --line-buffered -v Warn \
    | grep --line-buffered -E "FPS|loop closure|Error|error|Traceback" | sed -u "s/^/[$name] /" | tee -a "$OUT/revisits.log"; }

suite_revisits() { local part
  for part in ${PARTS:-walk tour}; do
    case "$part" in
      walk) revisit walk_flow walk:0 640x480 2000 flow off,on; revisit walk_all walk:0 640x480 2000 all "${ALL_MODES:-on}" ;;
      tour) wanted "${TOUR_KEYFRAMES:-flow all}" flow && revisit tour_flow tour:2 640x640 1500 flow off,on
            wanted "${TOUR_KEYFRAMES:-flow all}" all && revisit tour_all tour:2 640x640 1500 all "${ALL_MODES:-on}" ;;
      long) revisit "long_${LONG_KEYFRAMES:-all}" walk:0 640x480 10000 "${LONG_KEYFRAMES:-all}" "${LONG_MODES:-on}" ;;
      graph) timeout "${GRAPH_LIMIT_S:-400}" python3 scripts/bench_pose_graph.py --stream ${GRAPH_SIZES:-100 300 1000} \
               2>&1 | grep --line-buffered -v Warn | tee "$OUT/pose_graph.log" ;;
      *) echo "revisits: no part $part (walk tour long graph)" >&2; exit 2 ;;
    esac
  done
}

# -- the sky network beside the stream ---------------------------------------------------------------------
# onnxruntime-gpu from the parts in ORT_PARTS (.carry-ort/; the parts carried call by call gathered in a
# folder outside the checkout), checked against the SHA-256 in its wheel.sha256.
install_ort_gpu() { local parts=${ORT_PARTS:-.carry-ort} wheel
  wheel=/tmp/$(cut -d' ' -f3 "$parts/wheel.sha256")
  cat "$parts"/part-* > "$wheel" || exit 1
  (cd /tmp && sha256sum -c - <<< "$(cut -d' ' -f1 "$parts/wheel.sha256")  $(basename "$wheel")") || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheel" || exit 1
  python3 -c "import torch, onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())" \
    | tee -a "$OUT/gpu.txt"; }

suite_sky() { local round variant common
  install_ort_gpu
  mkdir -p /tmp/skyseg
  python3 scripts/probes/skyseg_standin.py -o /tmp/skyseg/skyseg.onnx --gflops "${SKY_GFLOPS:-120}" | tee -a "$OUT/sky.log"
  common=(--video-dir /tmp --frames "${FRAMES:-600}" --video-size "${SIZE:-640x480}" --no-engine-run --compile off)
  for round in $(seq "${ROUNDS:-2}"); do
    echo "== plain $round" | tee -a "$OUT/sky.log"
    python3 scripts/bench_e2e.py "${common[@]}" --json "$OUT/sky_plain_$round.json" 2>&1 | grep -v Warn | tail -2 >> "$OUT/sky.log"
    for variant in ${SKY_VARIANTS:-product fp32 fp32+whole fp32+sms16}; do
      echo "== $variant $round" | tee -a "$OUT/sky.log"
      STREAM_RECON_CHECKPOINTS=/tmp/skyseg python3 scripts/probes/sky_placement.py "$variant" "${common[@]}" \
        --mask-sky --json "$OUT/sky_${variant/+/_}_$round.json" 2>&1 | grep -v Warn | tail -3 >> "$OUT/sky.log"
    done
  done
  python3 - "$OUT" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("sky_*.json")):
    row = json.loads(path.read_text())
    print(f"{path.stem:28s} steady FPS {row.get('steady_fps')}")
PY
}

# -- the suite asked for -------------------------------------------------------------------------------------
case "$SUITE" in
  loops|maps|repro|soak-a|soak-b|soak-c|long|revisits) use_gtsam ;;
  sky) install_wheels .carry-ort ;;
  *) install_wheels .whl ;;
esac
case "$SUITE" in
  acceptance) suite_acceptance ;;
  e2e) suite_e2e "$@" ;;
  shapes-e2e) suite_shapes_e2e "$@" ;;
  shapes) suite_shapes ;;
  reference) suite_reference ;;
  engine) suite_engine "$@" ;;
  against) suite_against "$@" ;;
  gpu-tests) suite_gpu_tests "$@" ;;
  start) suite_start ;;
  spare) suite_spare "$@" ;;
  kernel) suite_kernel ;;
  probe) suite_probe "$@" ;;
  loops) suite_loops "$@" ;;
  maps) suite_maps ;;
  repro|soak-a|soak-b|soak-c|long) suite_never_hang "$SUITE" ;;
  revisits) suite_revisits ;;
  sky) suite_sky ;;
  *) usage ;;
esac
