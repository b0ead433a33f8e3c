#!/usr/bin/env bash
# Loop closure beside the stream on a GPU machine, the product path (scripts/bench_loop_closure.py: run_sequence
# with every output written, --loop-closure off then on, one process per cell), one cell per GPU at a time.
# Carry .carry-gtsam/ (plyfile's wheel and gtsam-py312.tar.xz: GTSAM's py3.12 wheel without its example
# data, tests and gtsam_unstable) and, for the scene cells, .carry-soak/SCENE.mp4 (an example scene of
# the official repository as a video). Every cell's JSON is a line of $OUT/soak.jsonl; its table lines go
# to $OUT/soak.log.
#
#   bash scripts/device/run_never_hang.sh repro      # the revisiting 640x480 video, flow keyframes, 1,000 frames
#   bash scripts/device/run_never_hang.sh soak-a     # oxford, university; bench_e2e's at 518x518 (flow, all); 10,000 on
#   bash scripts/device/run_never_hang.sh soak-b     # loop, courthouse; bench_e2e's at 518x392; 10,000 off
#   bash scripts/device/run_never_hang.sh soak-c     # bench_e2e's at 518x294, 518x378 (all: 3,000 frames), 518x518 interval:3
#   bash scripts/device/run_never_hang.sh long       # 10,000 frames, flow keyframes, loop closure on
#
# The soak's videos: bench_e2e's (the sample frames forwards and backwards while a crop pans) at each size
# and keyframe policy, and each scene played forwards and backwards at one size: a 640x480 video is read
# at 518x392, 640x468 at 518x378, 1280x720 at 518x294, 720x1280 at 518x518.
set -uo pipefail
OUT=${OUT:-/tmp/out}
FRAMES=${FRAMES:-2000}
mkdir -p "$OUT" /tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry-gtsam/*.whl
tar -xJf .carry-gtsam/gtsam-py312.tar.xz -C /tmp/site
mkdir -p /tmp/sr/stream_recon
for d in app models cache configs; do ln -sfn "$PWD/$d" /tmp/sr/stream_recon/$d; done
export PYTHONPATH=/tmp/sr:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import gtsam; print('gtsam', gtsam.__version__ if hasattr(gtsam, '__version__') else 'ok')"

# cell NAME KEYFRAMES VIDEO_SIZE FRAMES [SCENE] [MODES]: one process, at most CELL_LIMIT_S seconds (a hang
# shows as a timeout, and its line says so)
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

# Every job on stdin (one cell's arguments a line, the longest first) on every GPU, each GPU taking the
# next job when it is free.
run_jobs() { local gpus gpu; cat > /tmp/soak.jobs; rm -f /tmp/soak.taken
  gpus=$(nvidia-smi -L | wc -l)
  for ((gpu = 0; gpu < gpus; gpu++)); do
    ( export CUDA_VISIBLE_DEVICES=$gpu; while line=$(take_job); do read -r -a job <<< "$line"; cell "${job[@]}"; done ) &
  done
  wait; cat "$OUT/soak.log"; }

# jobs SIZE SCENE FRAMES: the three keyframe policies on one video (SCENE - : bench_e2e's video)
jobs() { local label=${2/#-/synthetic}
  for keyframes in flow all interval:3; do echo "${label}_${keyframes/:/}_$1 $keyframes $1 $3 $2"; done; }

case "${1:-repro}" in
  repro) cell repro_flow_392 flow 640x480 1000; cat "$OUT/soak.log" ;;
  soak-a) { echo "long_on flow 640x480 10000 - on"; jobs 720x1280 - "$FRAMES" | grep -v interval
            jobs 640x480 oxford "$FRAMES"; jobs 1280x720 university "$FRAMES"; } | run_jobs ;;
  soak-b) { echo "long_off flow 640x480 10000 - off"; jobs 720x1280 courthouse "$FRAMES"
            jobs 640x480 - "$FRAMES"; jobs 640x468 loop "$FRAMES"; } | run_jobs ;;
  soak-c) { jobs 720x1280 - "$FRAMES" | grep interval; echo "synthetic_all_640x468 all 640x468 3000 -"
            jobs 640x468 - "$FRAMES" | grep -v " all "; jobs 1280x720 - "$FRAMES"; } | run_jobs ;;
  long) cell long_flow_392 flow 640x480 10000 - on; cat "$OUT/soak.log" ;;
  *) echo "usage: $0 repro|soak-a|soak-b|soak-c|long" >&2; exit 2 ;;
esac
