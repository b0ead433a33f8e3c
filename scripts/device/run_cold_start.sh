#!/usr/bin/env bash
# A run's start on empty compile caches, part by part (scripts/probes/probe_cold_start.py), one process per
# row: compiled on empty caches, again on the caches it filled, uncompiled on empty caches and again,
# and compiled on empty caches with one compile thread. Each row's caches are its own folders, so the
# rows after the first see a fresh machine too. Then TEST_K's GPU tests ("" skips them).
#   (GPU machine, repository root, .whl carried)  HEIGHT=392 bash scripts/device/run_cold_start.sh
set -uo pipefail
source scripts/device/env.sh
probe() { local name=$1 dir=$2; shift 2; echo "== $name" | tee -a "$OUT/cold.log"
  TORCHINDUCTOR_CACHE_DIR=$dir TRITON_CACHE_DIR=$dir/triton python3 scripts/probes/probe_cold_start.py \
    --height "${HEIGHT:-392}" "$@" 2>&1 | grep -v Warn | tail -3 | tee -a "$OUT/cold.log"; }
probe compiled_cold /tmp/cold_compiled
probe compiled_warm /tmp/cold_compiled
probe eager_cold /tmp/cold_eager --no-compile
probe eager_warm /tmp/cold_eager --no-compile
TORCHINDUCTOR_COMPILE_THREADS=1 probe compiled_cold_one_thread /tmp/cold_serial
[[ -z ${TEST_K-x} ]] && exit 0
rm -rf /tmp/site/_pytest /tmp/site/pytest* /tmp/site/pluggy*
python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_fast_path.py -k "${TEST_K:-warm_up}" -s 2>&1 \
  | grep -v Warn > "$OUT/tests.log"; grep -E "warm-up|passed|failed|Error" "$OUT/tests.log" | tail -20
