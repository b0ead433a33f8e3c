#!/usr/bin/env bash
# A fresh machine's first run of a size, from the command's start to the 100th prediction, as a user
# meets it: the installed packages' bytecode written (pip does at install time), a 4.6 GB checkpoint of
# the official architecture (synthetic weights) loaded inside the run, --compile auto on compile caches
# that start empty ("machines" A, B, ...), scripts/bench_e2e.py at 640x480 (518x392), viewer with a
# client, every output written. With OLD=folder (a tree of app/ models/ cache/ configs/ of another
# commit), or TREES="name:folder ...", their runs alternate with this tree's, each on caches of its own:
# NEW then the others, ROUNDS times; the rows differ only by the package they import (this tree's
# bench_e2e.py measures every row).
# One throwaway process reads torch and the checkpoint first, so no row pays for the cold disk alone.
# E2E_ARGS: more options for every row (--timeline: what the main thread ran until the 100th prediction).
#   (GPU machine, repository root, .whl carried)  OLD=/tmp/old ROUNDS=2 bash scripts/device/run_first_prediction.sh
set -uo pipefail
source scripts/device/env.sh
write_bytecode
write_full_size_checkpoint
python3 -c "import torch; torch.load('/tmp/ckpt/full-size.pt', mmap=True, weights_only=True)" 2>&1 | grep -v Warn
TREES="${TREES:-}${OLD:+ old:$OLD}"  # name:folder pairs of other trees, alternating with this one
for tree in $TREES; do
  mkdir -p "/tmp/sr_${tree%%:*}/stream_recon"
  for d in app models cache configs; do ln -sfn "${tree#*:}/$d" "/tmp/sr_${tree%%:*}/stream_recon/$d"; done
done
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
  for tree in $TREES; do first_run "${tree%%:*}_$round" "/tmp/sr_${tree%%:*}"; done
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
