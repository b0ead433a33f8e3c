#!/usr/bin/env bash
# The engine bench of this checkout and of another one (e.g. the commit before a change), in one
# call, alternating, so that both numbers come from the same minutes of the same GPU.
#   (GPU machine, repository root, .whl carried, OTHER = a folder holding that checkout's
#    app/ models/ cache/ scripts/, carried too)
#   OTHER=.device-carry/old bash scripts/device/bench_against.sh [bench.py options ...]
set -uo pipefail
source scripts/device/env.sh
other=${OTHER:?name the other checkout in OTHER}
mkdir -p /tmp/sr-other/stream_recon
for d in app models cache; do ln -sfn "$PWD/$other/$d" /tmp/sr-other/stream_recon/$d; done
for round in $(seq 1 ${ROUNDS:-2}); do
  for side in this other; do
    if [ $side = this ]; then path=/tmp/sr script=scripts/bench.py; else path=/tmp/sr-other script=$other/scripts/bench.py; fi
    echo "== round $round, $side: $*" | tee -a "$OUT/bench.log"
    PYTHONPATH=$path:/tmp/site python3 $script "$@" --json "$OUT/bench_${side}_$round.json" 2>&1 | grep -v Warn \
      | grep -E "ms_per_frame|fps|peak|cold_start|attention|graphs|Error|error|Traceback" | tee -a "$OUT/bench.log"
  done
done
