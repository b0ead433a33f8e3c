#!/usr/bin/env bash
# Loop closure beside the stream on a GPU machine, the product path (scripts/bench_loop_closure.py: run_sequence
# with every output written, --loop-closure off then on, one process per cell). Carry .carry-gtsam/
# (plyfile's wheel and gtsam-py312.tar.xz: GTSAM's py3.12 wheel without its example data, tests and
# gtsam_unstable). Each cell's JSON lands in $OUT/soak_NAME.json and its table lines in $OUT/soak.log.
#
#   bash scripts/device/run_never_hang.sh repro      # the revisiting 640x480 video, flow keyframes, 1,000 frames
#   bash scripts/device/run_never_hang.sh soak       # keyframes all | flow | interval:3 at 518x294, 378, 392, 518
#   bash scripts/device/run_never_hang.sh long       # 10,000 frames, flow keyframes, loop closure on
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

# cell NAME KEYFRAMES VIDEO_SIZE FRAMES: off then on, at most CELL_LIMIT_S seconds (a hang shows as a timeout)
cell() { local name=$1 keyframes=$2 size=$3 frames=$4 started; started=$(date +%s)
  echo "== $name: --keyframes $keyframes, ${size} video, $frames frames" | tee -a "$OUT/soak.log"
  timeout "${CELL_LIMIT_S:-400}" python3 scripts/bench_loop_closure.py --frames "$frames" --warmup-frames 40 \
    --video-size "$size" --keyframes "$keyframes" --compile "${COMPILE:-auto}" --modes "${MODES:-off,on}" --json "$OUT/soak_$name.json" 2>&1 \
    | grep -v Warn | grep -E "FPS|loop closure|Error|error|Traceback" | tee -a "$OUT/soak.log"
  echo "   exit ${PIPESTATUS[0]} after $(( $(date +%s) - started )) s" | tee -a "$OUT/soak.log"; }

case "${1:-repro}" in
  repro) cell repro_flow_392 flow 640x480 1000 ;;
  soak) for keyframes in all flow interval:3; do for size in 1280x720 640x468 640x480 720x1280; do
          cell "${keyframes/:/}_${size}" "$keyframes" "$size" "$FRAMES"; done; done ;;
  long) MODES=on CELL_LIMIT_S=560 cell long_flow_392 flow 640x480 10000 ;;
  *) echo "usage: $0 repro|soak|long" >&2; exit 2 ;;
esac
