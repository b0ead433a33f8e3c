"""How the library attention kernels of the dense backends fill the GPU, and what running the rows
past their last whole wave in a launch of their own buys (GPU machine).

    python3 scripts/probe_library_waves.py --rows --json $OUT/library_waves.json

1. Frame sizes: one global layer of the backends `dense` (PyTorch's flash kernel), `dense-cudnn`
   and `dense-flashinfer` (fa2, and fa3 on Hopper; where FlashInfer is installed) at every 518 x h
   (h = 280 ... 518 by 14; the streaming shape: 72 frames of patch keys and 912 specials), with the
   leftover rows cut (leftover_rows.py) and without, each against the plain flash result
   (relative error).
2. --rows: each kernel's time against the query count, 512 ... 2,112 rows in steps of 32, at
   75,504 keys: where the time steps tells the rows of a program and the programs of a wave
   (leftover_rows.LIBRARY_KERNELS).
Medians of CUDA-event timings (triton.testing.do_bench, L2 cleared before each run).
"""

from __future__ import annotations

import argparse
import json
import traceback
from functools import partial

import torch
import triton

from stream_recon.cache import leftover_rows as lr
from stream_recon.cache.dense import VisibleRange
from stream_recon.cache.dense_attention import DenseAttention, DenseKV, SplitCudnnAttention

HEADS, HEAD_DIM, SPECIALS, FRAMES = 16, 64, 912, 72


def tokens(height: int, width: int = 518) -> int:
    return (height // 14) * (width // 14) + 6


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1000  # us


def relative_error(out, reference) -> float:
    return ((out.float() - reference.float()).norm() / reference.float().norm()).item()


def rows_sweep(num_keys: int) -> dict:
    kv = DenseKV(1, HEADS, HEAD_DIM, num_keys, torch.bfloat16, "cuda")
    kv.store.normal_()
    keys, values = kv.store[0, 0], kv.store[0, 1]  # [N, H, D]
    k, v = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    # name -> prepare(q [1, H, T, D]) -> a call to time
    kernels = {
        "flash": lambda q: lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v),
        "cudnn": lambda q: lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True),
    }
    kernels.update(flashinfer_kernels(kv))
    results = {}
    for name, prepare in kernels.items():
        series = []
        try:
            for rows in range(512, 2113, 32):
                call = prepare(torch.randn(1, HEADS, rows, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
                call()
                series.append((rows, round(bench(call), 1)))
        except Exception:
            traceback.print_exc()
        results[name] = series
        print(name, " ".join(f"{r}:{t}" for r, t in series), flush=True)
    return results


def flashinfer_kernels(kv) -> dict:
    """The dense-flashinfer backend over the store's whole range, uncut: fa2, and fa3 on Hopper."""
    try:
        from stream_recon.cache.flashinfer_backend import FlashInferRangeAttention
    except ImportError:
        print("flashinfer: not installed", flush=True)
        return {}
    variants = ["fa2"] + (["fa3"] if torch.cuda.get_device_capability()[0] == 9 else [])
    kernels = {}
    for variant in variants:
        backend = FlashInferRangeAttention(kv, variant)

        def prepare(q, backend=backend):
            backend.plan(VisibleRange(0, kv.capacity, 0), q.shape[2])
            tokens_first = q[0].transpose(0, 1).contiguous()
            return partial(backend.attend, 0, tokens_first)

        kernels[f"flashinfer-{variant}"] = prepare
    return kernels


def frame_sizes(heights: list[int]) -> list[dict]:
    rows = []
    for height in heights:
        num_queries = tokens(height)
        patches = num_queries - 6
        num_keys = FRAMES * patches + SPECIALS
        kv = DenseKV(1, HEADS, HEAD_DIM, num_keys + 300, torch.bfloat16, "cuda")
        kv.store.normal_()
        visible = VisibleRange(100, 100 + num_keys, 100 + SPECIALS)
        q = torch.randn(num_queries, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        row = {"height": height, "tokens": num_queries, "keys": num_keys}
        reference = None
        for name, backend in backends(kv, (FRAMES * patches,)).items():
            try:
                backend.plan(visible, num_queries)
                out = backend.attend(0, q)
                reference = out if reference is None else reference
                row[f"{name}_us"] = round(bench(partial(backend.attend, 0, q)), 1)
                row[f"{name}_error"] = relative_error(out, reference)
                row[f"{name}_whole_rows"] = backend.whole_rows
            except Exception:
                traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)
        del kv
        torch.cuda.empty_cache()
    return rows


def backends(kv, full: tuple[int, ...]) -> dict:
    """Each backend cut and uncut (the first: plain flash, the reference)."""
    made = {
        "dense": DenseAttention(kv),
        "dense_cut": DenseAttention(kv, lr.library_waves("flash", "cuda")),
        "cudnn": SplitCudnnAttention(kv, full),
        "cudnn_cut": SplitCudnnAttention(kv, full, fixed_shape_waves=lr.library_waves("cudnn", "cuda")),
    }
    try:
        from stream_recon.cache.flashinfer_backend import FlashInferRangeAttention
    except ImportError:
        return made
    made["fa2"] = FlashInferRangeAttention(kv, "fa2")
    made["fa2_cut"] = FlashInferRangeAttention(kv, "fa2", lr.library_waves("flashinfer-fa2", "cuda"))
    if torch.cuda.get_device_capability()[0] == 9:
        made["fa3"] = FlashInferRangeAttention(kv, "fa3")
    return made


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heights", default="280:518:14")
    parser.add_argument("--rows", action="store_true", help="the rows sweep too")
    parser.add_argument("--json")
    args = parser.parse_args()
    first, last, step = map(int, args.heights.split(":"))
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    print(report, flush=True)
    report["frame_sizes"] = frame_sizes(list(range(first, last + 1, step)))
    if args.rows:
        report["rows"] = rows_sweep(FRAMES * (tokens(392) - 6) + SPECIALS)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
