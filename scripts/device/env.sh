# Sourced by scripts/device/measure.sh (run from the repository root): $OUT, app/ models/ cache/ configs/
# exposed as stream_recon.* without pip (/tmp/sr), and the GPU recorded in $OUT/gpu.txt. The carried
# wheels go in with install_wheels (.whl: FlashInfer, viser and their needs) or use_gtsam (loop closure).
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/site
# The package of a tree at $2 (a folder holding app/ models/ cache/ configs/) as stream_recon under /tmp/$1.
link_package() { mkdir -p "/tmp/$1/stream_recon"
  for d in app models cache configs; do [ -e "$2/$d" ] && ln -sfn "$2/$d" "/tmp/$1/stream_recon/$d"; done; return 0; }
link_package sr "$PWD"
export PYTHONPATH=/tmp/sr:/tmp/site:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
# The carried wheels of folder $1 (default .whl) into /tmp/site; stops the script if there are none.
install_wheels() { local folder=${1:-.whl}
  ls "$folder"/*.whl >/dev/null 2>&1 || { echo "no wheels in $folder/: carry it" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$folder"/*.whl || exit 1; }
# Loop closure's set-up: the wheels of .carry-gtsam/ (plyfile, threadpoolctl; FlashInfer and apache-tvm-ffi where carried)
# and gtsam-py312.tar.xz (GTSAM's py3.12 wheel without its example data, tests and gtsam_unstable, which fits
# the transfer where the 34 MB wheel does not) into /tmp/site; stops the script if gtsam does not import.
use_gtsam() { install_wheels .carry-gtsam
  tar -xJf .carry-gtsam/gtsam-py312.tar.xz -C /tmp/site || exit 1
  python3 -c "import gtsam; print('gtsam', getattr(gtsam, '__version__', 'ok'))" | tee -a "$OUT/gpu.txt" || exit 1; }
# One product-path run of scripts/bench_e2e.py, named $1 (the rest are its options): its table into
# $OUT/e2e.log, its JSON into $OUT/e2e_$1.json.
e2e() { local name=$1; shift; echo "== $name: $*" | tee -a "$OUT/e2e.log"
  python3 scripts/bench_e2e.py --video-dir /tmp "$@" --json "$OUT/e2e_$name.json" 2>&1 | grep -v Warn | tail -30 \
    | tee -a "$OUT/e2e.log"; }
# Write the bytecode of the installed packages (torch's folder), as pip does at install time and this
# machine's image did not.
write_bytecode() {
  local site; site=$(python3 -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
  timeout 300 python3 -m compileall -q -j 16 "$site" >/dev/null 2>&1; }
# A checkpoint file of the official architecture (synthetic weights, 4.6 GB; MODEL_PRESET another preset's) at
# /tmp/ckpt/full-size.pt.
write_full_size_checkpoint() { mkdir -p /tmp/ckpt
  python3 - <<'PY' 2>&1 | grep -v Warn
import os, sys, time, torch
sys.path.insert(0, "scripts")
from bench import build_model
started = time.perf_counter()
model, _ = build_model(os.environ.get("MODEL_PRESET", "lingbot-map"))
torch.save(model.state_dict(), "/tmp/ckpt/full-size.pt")
print(f"checkpoint written in {time.perf_counter() - started:.1f} s")
PY
}
# Until no process is on the GPU (an earlier run's compile child, say), at most $1 seconds.
wait_for_idle_gpu() { for i in $(seq 1 "$1"); do
  [ -z "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ] && return; sleep 1; done; }
# A second process holds all but $1 MiB of the GPU (16376: what a 16 GB card reports in all) until killed;
# its pid in HOG, its line in $OUT/hog.log. Returns once it holds.
hold_all_but() { rm -f /tmp/hog_ready
  python3 - "$1" <<'PY' > "$OUT/hog.log" 2>&1 &
import sys, time, torch
torch.empty(1, device="cuda")
free, total = torch.cuda.mem_get_info()
keep = int(sys.argv[1]) * 2**20
hog = torch.empty(free - keep, dtype=torch.uint8, device="cuda")
free_after, _ = torch.cuda.mem_get_info()
print(f"hog holds {(free - keep) / 2**30:.2f} GiB; {free_after / 2**30:.2f} GiB free of {total / 2**30:.2f}", flush=True)
open("/tmp/hog_ready", "w").close()
time.sleep(3600)
PY
  HOG=$!
  for i in $(seq 1 120); do [ -f /tmp/hog_ready ] && break; sleep 1; done
  cat "$OUT/hog.log"; }
# Pack everything under $OUT into $OUT/out.tar.gz, the rest removed: the device tool brings back a few files
# per call, and one archive carries them all.
pack_out() { tar czf /tmp/out.tar.gz -C "$OUT" . && rm -rf "${OUT:?}"/* && mv /tmp/out.tar.gz "$OUT/"; }
# The GPU tests $TESTS (test files) with $TEST_K (their -k), when TESTS is set, on Inductor's and Triton's
# default caches, at most TEST_TIMEOUT (240) seconds; their log in $OUT/tests.log. $1: the script's start
# (date +%s), for the line that says when they began.
run_gpu_tests() { [ -n "${TESTS:-}" ] || return 0
  rm -rf /tmp/site/_pytest /tmp/site/pytest* /tmp/site/pluggy*  # a carried pytest would shadow the machine's
  echo "== GPU tests ($(( $(date +%s) - $1 )) s): $TESTS -k '${TEST_K:-}'"
  (unset TORCHINDUCTOR_CACHE_DIR TRITON_CACHE_DIR; timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider $TESTS -k "${TEST_K:-}") \
    > "$OUT/tests.log" 2>&1
  grep -E "passed|failed|FAILED|^E " "$OUT/tests.log" | tail -15; }
# One line per bench_e2e JSON under $OUT (e2e_*.json): the keys named in the arguments, the longest interval at
# a rollover over the median, and every interval over twice the median (frame, ms).
summarize_rows() { python3 - "$OUT" "$@" <<'PY'
import json, pathlib, sys
keys = sys.argv[2:]
for path in sorted(pathlib.Path(sys.argv[1]).glob("e2e_*.json")):
    row = json.loads(path.read_text())
    shown = {k: row[k] for k in keys if k in row}
    if row.get("rollover_longest_ms") and row.get("p50_ms"):
        shown["rollover_over_median"] = round(row["rollover_longest_ms"] / row["p50_ms"], 2)
    shown["over_2x"] = [(item["frame"], item["ms"]) for item in row.get("over_2x_median", [])]
    print(path.stem, json.dumps(shown))
PY
}
