#!/usr/bin/env bash
# The range kernel's loop variants and the frame attention's split (scripts/probes/probe_range_variants.py),
# then where a step's time goes at PROFILE heights (scripts/probes/profile_step.py --no-graphs), in one call.
#   (GPU machine, repository root, .whl carried)  PROFILE=392,518 bash scripts/device/run_variants.sh
set -uo pipefail
source scripts/device/env.sh
timeout ${PROBE_TIMEOUT:-240} python3 scripts/probes/probe_range_variants.py --heights "${HEIGHTS:-378,392,518,322}" \
  --json "$OUT/variants.json" 2>&1 | grep -v Warn | tee "$OUT/variants.log"
if [ -n "${PROFILE:-}" ]; then
  timeout ${PROFILE_TIMEOUT:-300} python3 scripts/probes/profile_step.py --no-graphs --height "$PROFILE" --frames 4 \
    --out "$OUT/profile" 2>&1 | grep -v Warn | tee "$OUT/profile.log" | head -80
fi
