#!/usr/bin/env bash
# The warm-up's dry pass (models/builds/kernel_builds.py) on a fresh machine: scripts/probes/probe_cold_start.py
# uncompiled at 518x$HEIGHT, one process per row, each pair of rows on compile caches of its own that
# start empty: with the dry pass on empty caches and again on the caches it filled, then the same
# without it (--no-dry-builds). Every Triton build is listed with its thread. The installed packages'
# bytecode is written first, as pip does, and one throwaway process reads torch from disk, so that the
# first row does not pay for the machine's cold disk alone. Then TEST_K's GPU tests ("" skips them).
#   (GPU machine, repository root, .whl carried)  HEIGHT=392 bash scripts/device/run_kernel_builds.sh
set -uo pipefail
source scripts/device/env.sh
write_bytecode
python3 -c "import torch, triton; torch.zeros(1, device='cuda')" 2>&1 | grep -v Warn
probe() { local name=$1 dir=$2; shift 2; echo "== $name" | tee -a "$OUT/builds.log"
  TORCHINDUCTOR_CACHE_DIR=$dir TRITON_CACHE_DIR=$dir/triton timeout 150 python3 scripts/probes/probe_cold_start.py \
    --height "${HEIGHT:-392}" --no-compile --triton-builds --frames 60 --timed 40 "$@" 2>&1 | grep -v Warn \
    | tail -3 | tee -a "$OUT/builds.log"; }
for order in ${ORDER:-dry plain}; do
  if [[ $order == dry ]]; then probe dry_cold /tmp/builds_dry; probe dry_warm /tmp/builds_dry
  else probe plain_cold /tmp/builds_plain --no-dry-builds; probe plain_warm /tmp/builds_plain --no-dry-builds; fi
done
[[ -z ${TEST_K-x} ]] && exit 0
rm -rf /tmp/site/_pytest /tmp/site/pytest* /tmp/site/pluggy*
timeout 280 python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_fast_path.py -k "${TEST_K:-side_by_side or warm_up}" \
  -s 2>&1 | grep -v Warn > "$OUT/tests.log"; grep -E "warm-up|passed|failed|Error|built" "$OUT/tests.log" | tail -20
