"""Host memory and time of loading the full-size checkpoint: .pt against .safetensors.

    python scripts/bench_checkpoint_load.py                   # writes both files to a temp folder, then deletes them
    python scripts/bench_checkpoint_load.py --folder /data/ckpt --keep
    python scripts/bench_checkpoint_load.py --device cuda
    python scripts/bench_checkpoint_load.py --device cuda --product   # as `stream-recon` loads: host, then prepared
    python scripts/bench_checkpoint_load.py --model tiny --repeat 1   # a smoke test of the script

The files hold the official architecture's tensors with the synthetic weights (models/synthetic.py):
the .pt written by torch.save, the .safetensors by our converter. Each load runs in a fresh process
that reports its peak resident set (VmHWM), so one load's memory never hides in another's. A
memory-mapped file's pages count once the process touches them, as in a user's run; the page cache
is warm after the first read, so the times are not disk times.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from stream_recon.models import GCTStream, ModelConfig
from stream_recon.models.checkpoint import convert_to_safetensors
from stream_recon.models.synthetic import synthetic_state_dict

OFFICIAL_PRESET = "lingbot-map"


def write_checkpoints(folder: Path, preset: str = OFFICIAL_PRESET) -> tuple[Path, Path]:
    """The .pt of `preset` (the official one: about 4.6 GB) and its conversion to .safetensors, unless
    already there."""
    stem = "full-size" if preset == OFFICIAL_PRESET else preset
    pt, converted = folder / f"{stem}.pt", folder / f"{stem}.safetensors"
    if not pt.is_file():
        with torch.device("meta"):
            model = GCTStream(ModelConfig.from_name(preset))
        state_dict = synthetic_state_dict(model)
        torch.save(state_dict, pt)
        del state_dict
    if not converted.is_file():
        convert_to_safetensors(pt, converted, architecture(preset))
    return pt, converted


def architecture(preset: str) -> ModelConfig | None:
    """What a load is told of the model: nothing for the official preset, which a load finds as the app's
    does (a .safetensors file's metadata, else the official architecture); a .pt of another preset
    cannot say what it holds."""
    return None if preset == OFFICIAL_PRESET else ModelConfig.from_name(preset)


def peak_rss_mib() -> float:
    """VmHWM, the process's peak resident set so far."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def measure_one(path: str, device: str, preset: str) -> dict:
    """Runs in the child process: one load_model, then the weight check alone on the loaded tensors."""
    from stream_recon.models import load_model
    from stream_recon.models.checkpoint import check_weight_values

    before = peak_rss_mib()
    start = time.perf_counter()
    model = load_model(path, device=device, config=architecture(preset))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    peak = peak_rss_mib()
    named = dict(model.named_parameters())
    start = time.perf_counter()
    check_weight_values(named, path)
    check_s = time.perf_counter() - start
    return {"file": Path(path).name, "device": device, "load_s": round(load_s, 2),
            "weight_check_s": round(check_s, 2), "peak_rss_mib": round(peak),
            "peak_rss_before_load_mib": round(before), "parameters": sum(p.numel() for p in named.values())}


def measure_product_load(path: str, device: str, preset: str) -> dict:
    """Runs in the child process: the checkpoint loaded as every command loads it (app.run.loading.load_model_for:
    read on the host, then prepared for the device in the run's precision, compiled where it is), each part timed."""
    from stream_recon.app.options import RunOptions
    from stream_recon.app.run.loading import prepared_for_run, resolve_device
    from stream_recon.models import load_model

    options = RunOptions(checkpoint=path, device=device)
    device = resolve_device(options.device)
    start = time.perf_counter()
    loaded = load_model(path, device="cpu", config=architecture(preset))
    read_s = time.perf_counter() - start
    start = time.perf_counter()
    prepared_for_run(loaded, options, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return {"file": Path(path).name, "device": device, "read_on_host_s": round(read_s, 2),
            "prepare_s": round(time.perf_counter() - start, 2), "peak_rss_mib": round(peak_rss_mib())}


def measure_in_child(path: Path, device: str, preset: str, product: bool = False) -> dict:
    command = [sys.executable, __file__, "--child", str(path), "--device", device, "--model", preset]
    command += ["--product"] if product else []
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"measuring {path} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", type=Path, help="where to write the two files (default: a temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the files afterwards")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=2, help="loads per format (the first reads the disk)")
    parser.add_argument("--product", action="store_true",
                        help="load as the app does (read on the host, then prepared for the device), each part timed")
    parser.add_argument("--model", default=OFFICIAL_PRESET,
                        help="model preset (tiny: a smoke test of the script)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        measure = measure_product_load if args.product else measure_one
        print(json.dumps(measure(args.child, args.device, args.model)))
        return
    folder = args.folder or Path(tempfile.mkdtemp(prefix="bench-checkpoint-"))
    folder.mkdir(parents=True, exist_ok=True)
    pt = converted = None
    try:
        start = time.perf_counter()
        pt, converted = write_checkpoints(folder, args.model)
        print(f"checkpoints ready in {time.perf_counter() - start:.0f} s: {pt} ({pt.stat().st_size:,} bytes), "
              f"{converted} ({converted.stat().st_size:,} bytes)", flush=True)
        for _ in range(args.repeat):
            for path in (pt, converted):
                print(json.dumps(measure_in_child(path, args.device, args.model, args.product)), flush=True)
    finally:
        if not args.keep:
            for path in (pt, converted):
                if path is not None:
                    path.unlink(missing_ok=True)
            if args.folder is None:
                folder.rmdir()


if __name__ == "__main__":
    main()
