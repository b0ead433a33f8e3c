"""How the library attention kernels of the dense backends fill the GPU, and what running the rows
past their last whole wave in a launch of their own buys (GPU machine).

    python3 scripts/probes/probe_library_waves.py --rows --json $OUT/library_waves.json

1. Frame sizes: one global layer of the backends `dense` (PyTorch's flash kernel), `dense-cudnn`
   and `dense-flashinfer` (fa2, and fa3 on Hopper; where FlashInfer is installed) at every 518 x h
   (h = 280 ... 518 by 14; the streaming shape: 72 frames of patch keys and 912 specials), with the
   leftover rows cut (leftover_rows.py) and without, each against the plain flash result
   (relative error).
2. --rows: each kernel's time against the query count, 512 ... 2,112 rows in steps of 32, at
   75,504 keys: where the time steps tells the rows of a program and the programs of a wave
   (leftover_rows.LIBRARY_KERNELS).
3. --pieces: at every frame size, (a) flash over the rows in launches that each take its split-KV
   path (at most leftover_rows.split_path_rows: the most rows FlashAttention-2 still splits),
   as a first piece of that many rows and the rest, or as equal pieces, against the whole-wave cut;
   (b) past cuDNN's whole waves, the leftover rows through cuDNN over the patch keys cut into groups
   of f frames (a batch), the specials through flash, merged by log-sum-exp, against the leftover
   through flash over every key.
Medians of CUDA-event timings (triton.testing.do_bench, L2 cleared before each run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import traceback
from functools import partial

import torch
import triton

from stream_recon.cache import leftover_rows as lr
from stream_recon.cache.dense import VisibleRange
from stream_recon.cache.dense_attention import (
    DenseAttention,
    DenseKV,
    SplitCudnnAttention,
    _sdpa_tokens,
    in_launches,
)
from stream_recon.cache.streams import run_beside

HEADS, HEAD_DIM, SPECIALS, FRAMES = 16, 64, 912, 72


def tokens(height: int, width: int = 518) -> int:
    return (height // 14) * (width // 14) + 6


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1000  # us


def relative_error(out, reference) -> float:
    return ((out.float() - reference.float()).norm() / reference.float().norm()).item()


def time_into(row: dict, label: str, call, reference=None, result=lambda out: out):
    """row[label_us], call's median time, and row[label_error], its output (through `result`) against
    `reference` (none: against itself); returns call's output. A failure is printed and leaves the row
    without them (None)."""
    try:
        out = call()
        row[f"{label}_us"] = round(bench(call), 1)
        compared = result(out)
        row[f"{label}_error"] = relative_error(compared, compared if reference is None else reference)
        return out
    except Exception:
        traceback.print_exc()
        return None


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
            except Exception:
                traceback.print_exc()
                continue
            out = time_into(row, name, partial(backend.attend, 0, q), reference)
            if out is not None:
                reference = out if reference is None else reference
                row[f"{name}_launch_ends"] = backend.launch_ends
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


def equal_piece_ends(rows: int, most: int) -> tuple[int, ...]:
    """Launch ends over `rows` rows in as many equal pieces as hold at most `most` rows each."""
    count = math.ceil(rows / most)
    return tuple(round(rows * (i + 1) / count) for i in range(count))


def flash_in_launches(keys, values, q, ends):
    return in_launches(lambda rows: _sdpa_tokens(rows, keys, values), q, ends)


def big_then_beside(side, big, small):
    """big() on the current stream, then small() on `side`, enqueued after big() but not waiting for
    it: the small launch's programs take what the big one leaves of the GPU."""
    current = torch.cuda.current_stream()
    before = torch.cuda.Event()
    before.record(current)
    first = big()
    side.wait_event(before)
    with torch.cuda.stream(side):
        second = small()
    current.wait_stream(side)
    return first, second


def flash_two_beside(keys, values, q, split_at, side, big_first):
    big = partial(_sdpa_tokens, q[:split_at], keys, values)
    small = partial(_sdpa_tokens, q[split_at:], keys, values)
    if big_first:
        first, second = big_then_beside(side, big, small)
    else:
        second, first = run_beside(side, small, big)
    return torch.cat([first, second])


def cudnn_leftover_beside(backend, q, side, big_first):
    """SplitCudnnAttention's cut step with its leftover rows (flash over every key) beside the
    whole rows' launches instead of after them."""
    visible, whole = backend._visible, backend.fixed_rows
    keys, values = (t.transpose(0, 1).unsqueeze(0) for t in backend.kv.keys_values(0, visible.start, visible.end))
    query = q.transpose(0, 1).unsqueeze(0)
    big = partial(backend._fixed_shape_rows, query[:, :, :whole], keys, values)
    small = partial(backend.any_shape_kernel, query[:, :, whole:], keys, values)
    if big_first:
        first, second = big_then_beside(side, big, small)
    else:
        second, first = run_beside(side, small, big)
    return torch.cat([first, second[0][0].transpose(0, 1)])


def cudnn_groups(q_rows, keys, values, specials: int, frames: int, frames_per_group: int):
    """q_rows [L, H, D] over keys/values [N, H, D] (specials first, then `frames` equal frames of
    patches): the patch keys as a batch of groups through cuDNN, the specials through flash.
    Returns the partial outputs [G + 1, H, L, D] and log-sum-exps [G + 1, H, L]."""
    groups = frames // frames_per_group
    patch_keys, patch_values = keys[specials:], values[specials:]
    per_group = patch_keys.shape[0] // groups

    def grouped(t):  # [G * n, H, D] -> [G, H, n, D], a view
        return t.view(groups, per_group, *t.shape[1:]).transpose(1, 2)

    query = q_rows.transpose(0, 1)[None]  # [1, H, L, D]
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query.expand(groups, -1, -1, -1), grouped(patch_keys), grouped(patch_values), None, True)[:2]
    special_out, special_lse = torch.ops.aten._scaled_dot_product_flash_attention(
        query, keys[:specials].transpose(0, 1)[None], values[:specials].transpose(0, 1)[None])[:2]
    shape = out.shape[:3]
    return (torch.cat([out, special_out]),
            torch.cat([lse.reshape(shape).float(), special_lse.reshape(special_out.shape[:3]).float()]))


def merge_partials(outs, lses):
    """[P, H, L, D] and [P, H, L] -> [L, H, D]."""
    top = lses.max(0).values
    weights = torch.exp(lses - top)
    merged = (outs.float() * weights[..., None]).sum(0) / weights.sum(0)[..., None]
    return merged.to(outs.dtype).transpose(0, 1)


def pieces(heights: list[int], beside_only: bool = False) -> list[dict]:
    flash_waves, cudnn_waves = lr.library_waves("flash", "cuda"), lr.library_waves("cudnn", "cuda")
    split = lr.split_path_rows(HEADS, flash_waves)
    print(f"flash split rows {split}", flush=True)
    side = torch.cuda.Stream()
    rows_out = []
    for height in heights:
        num_queries = tokens(height)
        patches = num_queries - 6
        num_keys = FRAMES * patches + SPECIALS
        kv = DenseKV(1, HEADS, HEAD_DIM, num_keys, torch.bfloat16, "cuda")
        kv.store.normal_()
        keys, values = kv.store[0, 0], kv.store[0, 1]
        q = torch.randn(num_queries, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        reference = _sdpa_tokens(q, keys, values)
        row = {"height": height, "tokens": num_queries, "keys": num_keys}
        # the whole waves' cut (the rule before the pieces), pieces of the split path and the rest, equal pieces
        candidates = {"flash_cut": lr.launch_ends(num_queries, HEADS, dataclasses.replace(flash_waves,
                                                                                          split_path_blocks=0.0))}
        if num_queries > split:
            candidates["flash_prefix"] = lr.launch_ends(num_queries, HEADS, flash_waves)
            candidates["flash_equal"] = equal_piece_ends(num_queries, split)
        for name, ends in candidates.items():
            if time_into(row, name, partial(flash_in_launches, keys, values, q, ends), reference) is None:
                continue
            row[f"{name}_ends"] = ends
            if len(ends) == 2 and name != "flash_equal":
                for big_first in (True, False):
                    time_into(row, f"{name}_beside_{'big' if big_first else 'small'}_first",
                              partial(flash_two_beside, keys, values, q, ends[0], side, big_first), reference)
        cudnn = SplitCudnnAttention(kv, (FRAMES * patches,), fixed_shape_waves=cudnn_waves)
        cudnn.plan(VisibleRange(0, num_keys, SPECIALS), num_queries)
        row["cudnn_cut_us"] = round(bench(partial(cudnn.attend, 0, q)), 1)
        if cudnn.fixed_rows < num_queries:
            for big_first in (True, False):
                time_into(row, f"cudnn_beside_{'big' if big_first else 'small'}_first",
                          partial(cudnn_leftover_beside, cudnn, q, side, big_first), reference)
        whole = lr.whole_wave_rows(num_queries, HEADS, cudnn_waves)
        if whole < num_queries:
            left = q[whole:]
            row["leftover_rows"] = num_queries - whole
            row["leftover_flash_us"] = round(bench(partial(_sdpa_tokens, left, keys, values)), 1)
            for per_group in (3, 9) if beside_only else (1, 2, 3, 4, 6, 8, 9, 12, 18, 24):
                partials = time_into(row, f"leftover_cudnn_f{per_group}",
                                     partial(cudnn_groups, left, keys, values, SPECIALS, FRAMES, per_group),
                                     reference[whole:], result=lambda parts: merge_partials(*parts))
                if partials is not None and per_group == 1:
                    row["merge_f1_us"] = round(bench(partial(merge_partials, *partials)), 1)
        rows_out.append(row)
        print(json.dumps(row), flush=True)
        del kv
        torch.cuda.empty_cache()
    return rows_out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heights", default="280:518:14")
    parser.add_argument("--rows", action="store_true", help="the rows sweep too")
    parser.add_argument("--pieces", action="store_true", help="flash in split-path pieces, cuDNN's leftover in key groups")
    parser.add_argument("--beside-only", action="store_true", help="with --pieces: two cuDNN key groupings only")
    parser.add_argument("--sizes", action="store_true", help="the frame-size sweep of every backend (section 1)")
    parser.add_argument("--json")
    args = parser.parse_args()
    first, last, step = map(int, args.heights.split(":"))
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "sms": torch.cuda.get_device_properties(0).multi_processor_count}
    print(report, flush=True)
    heights = list(range(first, last + 1, step))
    if args.sizes or not (args.rows or args.pieces):
        report["frame_sizes"] = frame_sizes(heights)
    if args.pieces:
        report["pieces"] = pieces(heights, beside_only=args.beside_only)
    if args.rows:
        report["rows"] = rows_sweep(FRAMES * (tokens(392) - 6) + SPECIALS)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)


if __name__ == "__main__":
    main()
