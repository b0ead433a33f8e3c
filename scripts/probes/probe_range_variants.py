"""Variants of the range kernel's inner loop and of the frame attention past one wave, one layer at
the streaming shape (GPU machine).

    python3 scripts/probes/probe_range_variants.py --json $OUT/variants.json

Each variant runs one program per tile (64 queries of one head against every visible key), so its
time is the loop's throughput, comparable with the production kernel's `grid` launch:
  - `lazy`: the running maximum is raised only when a block's maximum exceeds it by more than
    LAZY_THRESHOLD (base 2), so most blocks skip rescaling the accumulator; the exponentials then
    reach at most 2^LAZY_THRESHOLD, safe in float32 sums and bf16 probabilities;
  - `keys64`: key blocks of 64 rows with more of them in flight.
`--prefix-heights`: whole tiles against cutting every tile into a prefix (a share of its key
blocks) and equal pieces of the rest, merged (TileSchedule's prefix_share; sizes whose tiles fill
most of one wave).
`--stages-heights`: the production kernel (3 key blocks in flight, 2 programs per SM on Hopper)
against 2 blocks in flight (3 programs per SM), whole tiles and cut into pieces that fill the
larger wave. `--ncu HEIGHT`: launch the production kernel (and the 2-stage one) a few times at one
size and exit, for Nsight Compute to profile.
The frame attention (a frame's tokens among themselves) past one wave of cuDNN's tiles: cuDNN over
the rows that fill whole waves, the rest in a second call, concatenated.
Median of CUDA-event timings (triton.testing.do_bench, L2 cleared before each run), microseconds.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from stream_recon.cache import triton_attention as ta

HEADS, HEAD_DIM, SPECIALS = 16, 64, 912
LAZY_THRESHOLD = 8.0


_RUN_TABLES: dict[int, torch.Tensor] = {}


def one_run(key_range: torch.Tensor) -> torch.Tensor:
    """The production kernels' run table of one range [key_range[0], key_range[1]) (the variants read the range),
    made once per range tensor: the timed calls make none."""
    if key_range.data_ptr() not in _RUN_TABLES:
        start, end = key_range.tolist()
        _RUN_TABLES[key_range.data_ptr()] = torch.tensor(ta.run_table([(start, end - start)], 1), dtype=torch.int32,
                                                         device=key_range.device)
    return _RUN_TABLES[key_range.data_ptr()]


@triton.jit
def _variant_kernel(Q, keys, values, Out, key_range, stride_q, stride_o, num_queries, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LAZY: tl.constexpr,
                    THRESHOLD: tl.constexpr):
    tile = tl.program_id(0)
    start, end = tl.load(key_range), tl.load(key_range + 1)
    num_keys = end - start
    num_query_blocks = tl.cdiv(num_queries, BLOCK_M)
    head, query_block = tile // num_query_blocks, tile % num_query_blocks
    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_q + head * HEAD_DIM + dims[None, :], mask=rows[:, None] < num_queries,
                other=0.0)
    column = head * HEAD_DIM
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    last = num_keys // BLOCK_N
    for block in range(0, last):
        offset = start + block * BLOCK_N
        s = tl.dot(q, tl.trans(keys.load([offset, column])))
        v = values.load([offset, column])
        if LAZY:
            m_block = tl.max(s, 1) * qk_scale
            if tl.max(m_block - m_i, 0) > THRESHOLD:  # some row's maximum grew past the threshold
                m_new = tl.maximum(m_i, m_block)
                alpha = tl.math.exp2(m_i - m_new)
                l_i = l_i * alpha
                acc = acc * alpha[:, None]
                m_i = m_new
            p = tl.math.exp2(s * qk_scale - m_i[:, None])
            l_i = l_i + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            m_i, l_i, acc = ta._fold_block(s, v, m_i, l_i, acc, qk_scale)
    if last * BLOCK_N < num_keys:
        inside = last * BLOCK_N + tl.arange(0, BLOCK_N) < num_keys
        offset = start + last * BLOCK_N
        s = tl.where(inside[None, :], tl.dot(q, tl.trans(keys.load([offset, column]))), -float("inf"))
        v = tl.where(inside[:, None], values.load([offset, column]), 0.0)
        m_i, l_i, acc = ta._fold_block(s, v, m_i, l_i, acc, qk_scale)
    out = acc / l_i[:, None]
    tl.store(Out + rows[:, None] * stride_o + head * HEAD_DIM + dims[None, :], out.to(Out.dtype.element_ty),
             mask=rows[:, None] < num_queries)


def probe_prefix(height: int) -> dict:
    """Whole tiles (one program each) against prefix cuts (pieces a tile, prefix share) at one
    size, the whole tiles timed before, between and after them."""
    q, keys, values, key_range = streaming_layer(height)
    num_queries = q.shape[0]
    tiles = math.ceil(num_queries / ta.BLOCK_QUERIES) * HEADS
    slots = ta.resident_programs(q, keys, values)
    whole = ta.TileSchedule(tiles, 0, 1)
    reference = ta.attend_range_scheduled(q, keys, values, one_run(key_range), slots, schedule=whole)
    whole_tiles = lambda: ta.attend_range_scheduled(q, keys, values, one_run(key_range), slots, schedule=whole)  # noqa: E731
    row = {"height": height, "tokens": num_queries, "whole_us": [bench(whole_tiles)], "prefix_us": {}}
    for splits in (2, 3, 4, 5, 7):
        for share in (700, 750, 800, 850, 900):
            schedule = ta.TileSchedule(0, tiles, splits, share)
            run = lambda schedule=schedule: ta.attend_range_scheduled(q, keys, values, one_run(key_range), slots,  # noqa: E731
                                                                      schedule=schedule)
            assert error(run(), reference) < 1e-2, (height, splits, share)
            row["prefix_us"][f"{splits}:{share}"] = bench(run)
        row["whole_us"].append(bench(whole_tiles))
    best = min(row["prefix_us"].items(), key=lambda item: item[1])
    print(f"518x{height} T={num_queries}: whole tiles {' '.join(f'{x:.0f}' for x in row['whole_us'])} | best "
          f"prefix cut {best[0]} {best[1]:.0f} | " + " ".join(f"{k} {v:.0f}" for k, v in row["prefix_us"].items()),
          flush=True)
    return row


def streaming_layer(height: int, peaked_keys: bool = False):
    """q, keys, values and the key range of one global layer at 518 x height (random bf16); with
    `peaked_keys` the keys are tripled: peaked scores, as a trained model's are, so that the running
    maximum moves more often."""
    num_queries = (height // 14) * 37 + 6
    num_keys = 72 * (num_queries - 6) + SPECIALS
    store = torch.randn(2, num_keys + 300, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    if peaked_keys:
        store[0] *= 3
    key_range = torch.tensor([100, 100 + num_keys], dtype=torch.int32, device="cuda")
    q = torch.randn(num_queries, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    return q, store[0], store[1], key_range


# (label, num_stages, schedule of `tiles` tiles): the stage and cut candidates of --stages-heights
def stage_candidates(tiles: int):
    yield "3 stages, whole", 3, ta.TileSchedule(tiles, 0, 1)
    yield "2 stages, whole", 2, ta.TileSchedule(tiles, 0, 1)
    for splits, share in ((2, 0), (3, 0), (2, 500), (2, 600), (2, 700), (3, 600)):
        yield f"2 stages, {splits}:{share}", 2, ta.TileSchedule(0, tiles, splits, share)
    yield "3 stages, 2:850", 3, ta.TileSchedule(0, tiles, 2, 850)


def probe_stages(height: int) -> dict:
    q, keys, values, key_range = streaming_layer(height)
    tiles = math.ceil(q.shape[0] / ta.BLOCK_QUERIES) * HEADS
    slots = {stages: ta.resident_programs(q, keys, values, stages) for stages in (2, 3)}
    reference = ta.attend_range_scheduled(q, keys, values, one_run(key_range), slots[3], schedule=ta.TileSchedule(tiles, 0, 1))
    row = {"height": height, "tokens": q.shape[0], "tiles": tiles, "slots": slots, "us": {}}
    for _repeat in range(2):
        for label, stages, schedule in stage_candidates(tiles):
            run = lambda stages=stages, schedule=schedule: ta.attend_range_scheduled(  # noqa: E731
                q, keys, values, key_range, slots[stages], schedule=schedule, num_stages=stages)
            assert error(run(), reference) < 1e-2, (height, label)
            row["us"].setdefault(label, []).append(bench(run))
    print(f"518x{height} T={q.shape[0]} tiles {tiles} slots {slots}: " +
          " | ".join(f"{k} {' '.join(f'{x:.0f}' for x in v)}" for k, v in row["us"].items()), flush=True)
    return row


def launch_for_profiler(height: int) -> None:
    """A few launches of the production kernel (3 stages) and of the 2-stage one, whole tiles."""
    q, keys, values, key_range = streaming_layer(height)
    tiles = math.ceil(q.shape[0] / ta.BLOCK_QUERIES) * HEADS
    for stages in (3, 2):
        for _ in range(3):
            ta.attend_range_scheduled(q, keys, values, one_run(key_range), ta.resident_programs(q, keys, values, stages),
                                      schedule=ta.TileSchedule(tiles, 0, 1), num_stages=stages)
    torch.cuda.synchronize()


def variant(q, keys, values, key_range, *, lazy: bool, block_keys: int, num_stages: int):
    num_queries = q.shape[0]
    out = torch.empty_like(q)
    flat = [t.flatten(1) for t in (keys, values)]
    descriptors = [TensorDescriptor(t, list(t.shape), list(t.stride()), [block_keys, HEAD_DIM]) for t in flat]
    grid = (triton.cdiv(num_queries, ta.BLOCK_QUERIES) * HEADS,)
    _variant_kernel[grid](q, *descriptors, out, key_range, q.stride(0), out.stride(0), num_queries,
                          HEAD_DIM**-0.5 * ta.LOG2_E, HEAD_DIM=HEAD_DIM, BLOCK_M=ta.BLOCK_QUERIES, BLOCK_N=block_keys,
                          LAZY=lazy, THRESHOLD=LAZY_THRESHOLD, num_warps=ta.NUM_WARPS, num_stages=num_stages)
    return out


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1000


def error(out, reference) -> float:
    return ((out.float() - reference.float()).norm() / reference.float().norm()).item()


def probe(height: int, slots: int, scaled_keys: bool) -> dict:
    q, keys, values, key_range = streaming_layer(height, peaked_keys=scaled_keys)
    num_queries = q.shape[0]
    start, end = key_range.tolist()
    num_keys = end - start
    reference = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], keys[start:start + num_keys].float().transpose(0, 1)[None],
        values[start:start + num_keys].float().transpose(0, 1)[None])[0].transpose(0, 1)
    tiles = math.ceil(num_queries / ta.BLOCK_QUERIES) * HEADS
    grid = ta.TileSchedule(tiles, 0, 1)
    row = {"height": height, "tokens": num_queries, "keys": num_keys, "tiles": tiles, "peaked": scaled_keys}
    production = lambda: ta.attend_range_scheduled(q, keys, values, one_run(key_range), slots, schedule=grid)  # noqa: E731
    row["grid_error"] = error(production(), reference)
    row["grid_us"] = bench(production)
    row["balanced_us"] = bench(lambda: ta.attend_range(q, keys, values, one_run(key_range)))
    for name, kwargs in (("plain", dict(lazy=False, block_keys=128, num_stages=3)),
                         ("lazy", dict(lazy=True, block_keys=128, num_stages=3)),
                         ("keys64_s4", dict(lazy=False, block_keys=64, num_stages=4)),
                         ("keys64_s5", dict(lazy=False, block_keys=64, num_stages=5)),
                         ("lazy_keys64_s4", dict(lazy=True, block_keys=64, num_stages=4))):
        try:
            run = lambda kwargs=kwargs: variant(q, keys, values, key_range, **kwargs)  # noqa: E731
            row[f"{name}_error"] = error(run(), reference)
            row[f"{name}_us"] = bench(run)
        except Exception as failure:  # (a variant that does not compile or fit costs only its row)
            row[f"{name}_failed"] = f"{type(failure).__name__}: {str(failure)[:200]}"
    if not scaled_keys:
        row.update(frame_variants(num_queries))
    return row


def frame_variants(num_queries: int) -> dict:
    qkv = torch.randn(1, num_queries, 3, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    q, k, v = [t.transpose(1, 2) for t in qkv.unbind(2)]  # [1, H, N, D] views, as Attention.heads makes them
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    whole = (264 // HEADS) * 64  # rows whose 64-row tiles fill one wave of cuDNN's (264 on 132 SMs)

    def split():
        first = F.scaled_dot_product_attention(q[:, :, :whole], k, v)
        rest = F.scaled_dot_product_attention(q[:, :, whole:], k, v)
        return torch.cat([first, rest], dim=2)

    row = {"frame_sdpa_us": bench(lambda: F.scaled_dot_product_attention(q, k, v)),
           "frame_attend_frame_us": bench(lambda: ta.attend_frame(q, k, v))}
    if num_queries > whole:
        row["frame_split_error"] = error(split(), expected)
        row["frame_split_us"] = bench(split)
        row["frame_first_rows_us"] = bench(lambda: F.scaled_dot_product_attention(q[:, :, :whole], k, v))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heights", default="378,392,518,322")
    parser.add_argument("--prefix-heights", default="", help="time prefix cuts at these heights instead (comma list)")
    parser.add_argument("--stages-heights", default="", help="time 2 against 3 stages at these heights instead")
    parser.add_argument("--ncu", type=int, help="launch the kernel at this height for a profiler, and exit")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.ncu:
        launch_for_profiler(args.ncu)
        return
    for heights, probe_at in ((args.stages_heights, probe_stages), (args.prefix_heights, probe_prefix)):
        if heights:
            rows = [probe_at(int(h)) for h in heights.split(",")]
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
            return
    probe_q = torch.randn(64, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    probe_store = torch.randn(2, 256, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    slots = ta.resident_programs(probe_q, probe_store[0], probe_store[1])
    rows = []
    for height in (int(h) for h in args.heights.split(",")):
        for peaked in (False, True):
            row = probe(height, slots, peaked)
            rows.append(row)
            print(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(), "slots": slots, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
