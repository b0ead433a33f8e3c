#!/usr/bin/env bash
# Compiled code kept between runs (models/builds/compilation.py) on the product path: 518x392, 1,000 frames,
# defaults, viewer with a client; one process per run on a fresh machine, each RUNS entry mode:name
# (mode `kept`: artefacts under ~/.cache/stream-recon/compiled, the first such run compiles and keeps
# them, later ones load them; mode `usual`: STREAM_RECON_COMPILED="", torch.compile where called).
# Then the GPU tests of the artefacts (TEST_K="" skips them).
#   (GPU machine, repository root, .whl carried)  bash scripts/device/run_compiled_code.sh
set -uo pipefail
source scripts/device/env.sh
for spec in ${RUNS:-kept:first kept:second kept:third}; do
  mode=${spec%%:*}; name=${spec#*:}
  if [[ $mode == usual ]]; then export STREAM_RECON_COMPILED=""; else unset STREAM_RECON_COMPILED; fi
  e2e "$name" --frames 1000 --video-size ${VIDEO_SIZE:-640x480} --viewer --client --no-engine-run ${E2E_EXTRA:-}
done
unset STREAM_RECON_COMPILED
du -sh ~/.cache/stream-recon/compiled | tee -a "$OUT/e2e.log"
find ~/.cache/stream-recon/compiled -name '*.pt' | wc -l | tee -a "$OUT/e2e.log"
[[ -z ${TEST_K-x} ]] && exit 0
rm -rf /tmp/site/_pytest /tmp/site/pytest* /tmp/site/pluggy*
python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_fast_path.py -k "${TEST_K:-compiled_code_kept or fastest or official_outputs}" \
  -s 2>&1 | grep -v Warn > "$OUT/tests.log"; grep -E "compiled, then|passed|failed|Error" "$OUT/tests.log" | tail -20
