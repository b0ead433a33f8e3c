#!/usr/bin/env bash
# Frame sizes on the GPU machine, in one call: helper processes compile every size's blocks and heads
# (torch.compile, per input size) and the sweep's process builds its model, while the GPU tests run
# (TESTS, TEST_K) or, without tests, the attention probe; then the engine per size and variant
# (scripts/bench_shapes.py, for DEADLINE seconds); then, in the time left before LIMIT_S, the
# attention probe at PROBE_HEIGHTS (after tests).
#   (GPU machine, repository root, .whl carried; tests/golden for the tests; for the `previous`
#    variant, the range kernel of the commit to compare with in cache/triton_attention_previous.py:
#    git show COMMIT:cache/triton_attention.py > cache/triton_attention_previous.py, not committed)
#   HEIGHTS=378,392,518 PROFILE=378,392 TESTS="tests/test_gpu_fp8.py" TEST_K=range bash scripts/device/run_shapes.sh
#   AFTER=FILE: the sweep waits for FILE too (a caller's own GPU work, run beside the compile helpers)
set -uo pipefail
source scripts/device/env.sh
began=$(date +%s)
limit=${LIMIT_S:-580}
heights=${HEIGHTS:-280:518:14}
workers=${WORKERS:-4}
probe() {
  timeout $1 python3 scripts/probes/probe_attention_schedule.py --heights "${PROBE_HEIGHTS-280:518:14}" \
    --others "${OTHERS-392,434,518}" --json "$OUT/probe.json" 2>&1 | grep -v Warn | tee "$OUT/probe.log"
}
rm -f /tmp/gpu_free
python3 scripts/bench_shapes.py --heights "$heights" --profile "${PROFILE:-}" --frames ${FRAMES:-40} \
  --deadline-s ${DEADLINE:-400} --variants ${VARIANTS:-previous,frames} --more "${MORE:-}" --json "$OUT/shapes.json" \
  --wait-for /tmp/gpu_free > "$OUT/shapes.log" 2>&1 &
sweep=$!
for i in $(seq 0 $((workers - 1))); do
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=4 python3 scripts/bench_shapes.py --compile-only \
    --heights "$heights" --share $i/$workers >> "$OUT/compile.log" 2>&1 &
done
if [ -n "${TESTS:-}" ]; then
  echo "== GPU tests: $TESTS -k '${TEST_K:-}'"
  timeout ${TEST_TIMEOUT:-260} python3 -m pytest -q -s -p no:cacheprovider --durations=30 $TESTS -k "${TEST_K:-}" 2>&1 \
    | tee "$OUT/tests.log" | grep -E "vs golden|vs eager|sigma|passed|failed|Error|error|FAILED|PASSED|^E |s call" | tail -60
elif [ -n "${PROBE_HEIGHTS-280:518:14}" ]; then
  probe ${PROBE_TIMEOUT:-240}
fi
while [ $(jobs -rp | grep -vc "^$sweep$") -gt 0 ]; do sleep 1; done  # the compile helpers
while [ -n "${AFTER:-}" ] && [ ! -e "$AFTER" ]; do sleep 1; done  # whatever else the caller runs on the GPU
grep -E "compiled|Error|error" "$OUT/compile.log" | tail -30
echo "== sweep from $(( $(date +%s) - began )) s"
touch /tmp/gpu_free  # the sweep (its model built meanwhile) measures from now, until DEADLINE
wait $sweep
grep -v -E "Warn|warn" "$OUT/shapes.log" | tail -40
left=$(( limit - ($(date +%s) - began) ))
if [ -n "${TESTS:-}" ] && [ -n "${PROBE_HEIGHTS:-}" ] && [ $left -gt 30 ]; then
  probe $left
fi
