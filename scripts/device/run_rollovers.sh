#!/usr/bin/env bash
# Window rollovers on the GPU machine (issue 16), one call: the lookahead's GPU tests, then the product
# path with keyframes all and flow (viewer + client, every output), JSON and logs under $OUT.
#   (GPU machine, repository root, .whl carried)  bash scripts/device/run_rollovers.sh [extra bench_e2e options]
set -uo pipefail
source scripts/device/env.sh >/dev/null
timeout "${TEST_S:-170}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu_fast_path.py -k "${TESTS_K:-spare or lookahead}" \
  2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|Error|FAILED|^E " | tail -30
if [ -n "${BUDGETS:-}" ]; then  # the engine alone around rollovers, at these lookahead budgets
  timeout "${ROLLOVER_S:-150}" python3 scripts/bench_rollover.py --budgets $BUDGETS 2>&1 | grep -v Warn | tail -24 \
    | tee "$OUT/rollover.log"
fi
e2e() { local name=$1; shift; echo "== $name: $*" | tee -a "$OUT/e2e.log"
  timeout "${E2E_S:-200}" python3 scripts/bench_e2e.py --video-dir /tmp "$@" --json "$OUT/e2e_$name.json" 2>&1 \
    | grep -v Warn | tail -22 | tee -a "$OUT/e2e.log"; }
e2e all --frames 1000 --viewer --client "$@"
e2e flow --frames 1000 --keyframes flow --flow-threshold 1e9 --max-gap 3 --viewer --client "$@"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("e2e_*.json")):
    r = json.loads(path.read_text())
    print(path.stem, {k: r.get(k) for k in ("steady_fps", "engine_fps", "p50_ms", "p99_ms", "longest_stall_ms",
                                             "longest_stall_frame", "switch_delays", "around_rollovers")})
PY
