"""The global and the frame attention of one layer across frame sizes, per schedule and backend
(GPU machine).

    python3 scripts/probes/probe_attention_schedule.py --json $OUT/probe.json

For each frame of 518 x h pixels (h = 280 ... 518 in 14-pixel steps: T = 37 * h/14 + 6 tokens) it
times, at the streaming shape (T queries, 16 heads of 64, 72 frames of patch keys plus 912 special
keys, the bench's steady state):
  - the range kernel before the balanced schedule (cache/triton_attention_previous.py, where the
    device script puts the previous commit's module), the range kernel with one program per tile,
    and with the balanced schedule (schedule_tiles), each checked against SDPA;
  - the same with the tiles numbered query block first (every head's partial block last);
  - at the --others heights: every number of key chunks for the leftover that changes the rounds,
    128-query tiles (8 warps), and the other dense backends `auto` can pick (dense: PyTorch's flash
    and efficient kernels; dense-cudnn: cuDNN on the patch keys, flash on the specials, merged);
  - the frame attention (one frame's T tokens among themselves, the DINO and frame blocks'): SDPA
    (cuDNN), attend_frame, and the range kernel with two and three key blocks in flight (the two
    checked against SDPA).
Median of CUDA-event timings (triton.testing.do_bench, which clears L2 before each run).
"""

from __future__ import annotations

import argparse
import json
import math
import traceback

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from stream_recon.cache import DenseKV, VisibleRange
from stream_recon.cache import triton_attention as ta
from stream_recon.cache.dense_attention import DenseAttention, SplitCudnnAttention

HEADS, HEAD_DIM, SPECIALS = 16, 64, 912


def tokens(height: int, width: int = 518) -> int:
    return (height // 14) * (width // 14) + 6


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=80, return_mode="median") * 1000  # us


def probe_size(height: int, slots: int, others: bool, previous) -> dict:
    num_queries = tokens(height)
    patches = num_queries - 6
    num_keys = 72 * patches + SPECIALS
    kv = DenseKV(1, HEADS, HEAD_DIM, num_keys + 300, torch.bfloat16, "cuda")
    kv.store.normal_()
    start = 100  # (not a multiple of the key block, as in the stream)
    visible = VisibleRange(start, start + num_keys, start + SPECIALS)
    key_range = torch.tensor([visible.start, visible.end], dtype=torch.int32, device="cuda")
    q = torch.randn(num_queries, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    keys, values = kv.store[0, 0], kv.store[0, 1]
    num_tiles = math.ceil(num_queries / ta.BLOCK_QUERIES) * HEADS
    num_key_blocks = math.ceil(keys.shape[0] / ta.BLOCK_KEYS)
    flops = 4.0 * num_queries * num_keys * HEADS * HEAD_DIM
    row = {"height": height, "tokens": num_queries, "keys": num_keys, "tiles": num_tiles, "slots": slots,
           "schedule": ta.schedule_tiles(num_tiles, slots, num_key_blocks).__dict__}

    def scheduled(schedule=None, **kwargs):
        return lambda: ta.attend_range_scheduled(q, keys, values, key_range, slots, schedule=schedule, **kwargs)

    def error(out, reference):
        return ((out.float() - reference.float()).norm() / reference.float().norm()).item()

    grid = ta.TileSchedule(num_tiles, 0, 1)
    reference = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[start:start + num_keys].transpose(0, 1)[None],
                                               values[start:start + num_keys].transpose(0, 1)[None])[0].transpose(0, 1)
    row["balanced_error"] = error(scheduled()(), reference)
    if previous is not None:
        row["previous_error"] = error(previous.attend_range(q, keys, values, key_range), reference)
        row["previous_us"] = bench(lambda: previous.attend_range(q, keys, values, key_range))
    row["grid_us"] = bench(scheduled(grid))
    row["balanced_us"] = bench(scheduled())
    row["balanced_tflops"] = flops / row["balanced_us"] / 1e6
    leftover = num_tiles % slots
    row["splits_us"] = {}
    if leftover and others:
        most = min(num_key_blocks, ta.MAX_SPLITS, ta.MAX_PIECES_PER_SLOT * slots // leftover)

        def rounds(splits):
            return math.ceil(leftover * splits / slots)

        for splits in range(2, most + 1):
            # of a run of chunk counts taking as many rounds, the last (smallest pieces) and the first
            if splits == most or rounds(splits + 1) > rounds(splits) or rounds(splits - 1) < rounds(splits):
                row["splits_us"][splits] = bench(scheduled(ta.TileSchedule(num_tiles - leftover, leftover, splits)))
    if num_tiles > slots:
        row["tails_last_grid_us"] = bench(scheduled(grid, tails_last=True))
        row["tails_last_balanced_us"] = bench(scheduled(tails_last=True))
    with torch.no_grad():
        if others:
            tiles128 = math.ceil(num_queries / 128) * HEADS
            row["block128_us"] = bench(scheduled(ta.TileSchedule(tiles128, 0, 1), block_queries=128, num_warps=8))

            def backend_us(backend):
                backend.plan(visible, num_queries)
                return bench(lambda: backend.attend(0, q))

            row["dense_flash_us"] = backend_us(DenseAttention(kv))
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                full = [t[start:start + num_keys].transpose(0, 1)[None] for t in (keys, values)]
                row["dense_efficient_us"] = bench(lambda: F.scaled_dot_product_attention(q.transpose(0, 1)[None], *full))
            row["dense_cudnn_us"] = backend_us(SplitCudnnAttention(kv, (num_keys - SPECIALS,)))
        # a frame over itself, q, k, v as Attention.heads makes them: views of one token-major qkv
        qkv = torch.randn(1, num_queries, 3, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        frame = [t.transpose(1, 2) for t in qkv.unbind(2)]  # [1, H, N, D]
        expected = F.scaled_dot_product_attention(*(t.float() for t in frame))
        tokens_view = [t[0].transpose(0, 1) for t in frame]  # [N, H, D]
        two_stages = ta.attend_range(*tokens_view, (0, num_queries), num_stages=ta.FRAME_NUM_STAGES)
        row["frame_range_error"] = error(two_stages.transpose(0, 1)[None], expected)
        row["frame_sdpa_us"] = bench(lambda: F.scaled_dot_product_attention(*frame))
        row["frame_attend_frame_us"] = bench(lambda: ta.attend_frame(*frame))
        row["frame_range_2_stages_us"] = bench(
            lambda: ta.attend_range(*tokens_view, (0, num_queries), num_stages=ta.FRAME_NUM_STAGES))
        row["frame_range_3_stages_us"] = bench(lambda: ta.attend_range(*tokens_view, (0, num_queries)))
        if others:
            for name, kind in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                with sdpa_kernel([kind]):
                    row[f"frame_{name}_us"] = bench(lambda: F.scaled_dot_product_attention(*frame))
    del kv
    torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heights", default="280:518:14", help="first:last:step, or a comma list")
    parser.add_argument("--json")
    parser.add_argument("--others", default="392,434,518",
                        help="heights also timed with every chunk count, 128-query tiles and the other backends")
    args = parser.parse_args()
    heights = parse_heights(args.heights)
    others = set(parse_heights(args.others)) if args.others else set()
    try:  # the kernel before this schedule, where the device script put it (not part of the package)
        from stream_recon.cache import triton_attention_previous as previous
    except ImportError:
        previous = None
    q = torch.randn(64, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    store = torch.randn(2, 256, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    slots = ta.resident_programs(q, store[0], store[1])
    for stages in (ta.NUM_STAGES, ta.FRAME_NUM_STAGES):
        kernel = ta._compiled_range_kernel(q, store[0], store[1], stages, ta.tensor_memory_loads(q.device))
        kernel._init_handles()  # (the registers per thread are known once the binary is loaded)
        print(f"{torch.cuda.get_device_name()}, {stages} stages: {ta.resident_programs(q, store[0], store[1], stages)} "
              f"resident programs ({kernel.metadata.shared} B shared, {kernel.n_regs} registers per thread)", flush=True)
    rows = []
    for height in heights:
        try:
            row = probe_size(height, slots, height in others, previous)
        except Exception:  # one size failing should not cost the others
            traceback.print_exc()
            continue
        rows.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "slots": slots, "rows": rows}, f, indent=1)
        print(describe(row), flush=True)


def describe(row: dict) -> str:
    """One line per size: the kernels' microseconds, the schedule and the errors."""
    extra = " ".join(f"{k.removesuffix('_us')} {v:.0f}" for k, v in row.items()
                     if k.endswith("_us") and k not in ("grid_us", "balanced_us", "previous_us", "splits_us")
                     and not k.startswith("frame"))
    frame = " ".join(f"{k.removeprefix('frame_').removesuffix('_us')} {v:.1f}" for k, v in row.items()
                     if k.startswith("frame") and k.endswith("_us"))
    splits = " ".join(f"{s}:{us:.0f}" for s, us in row["splits_us"].items())
    return (f"518x{row['height']} T={row['tokens']} tiles={row['tiles']} {tuple(row['schedule'].values())} "
            f"err {row['balanced_error']:.1e}/{row.get('previous_error', 0):.1e}/{row['frame_range_error']:.1e} | "
            f"previous {row.get('previous_us', 0):.0f} grid {row['grid_us']:.0f} balanced {row['balanced_us']:.0f} "
            f"({row['balanced_tflops']:.0f} TFLOP/s) {extra} | frame {frame} | splits {splits}")


def parse_heights(text: str) -> list[int]:
    if ":" in text:
        first, last, step = map(int, text.split(":"))
        return list(range(first, last + 1, step))
    return [int(h) for h in text.split(",") if h]


if __name__ == "__main__":
    main()
