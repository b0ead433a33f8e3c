"""The range kernel's loop written in Gluon (Triton's lower-level language), where the
tensor-core products and the softmax overlap by hand, against the Triton range kernel, one
layer at the streaming shape (GPU machine; built and timed with Triton 3.6, built with 3.9 too:
Gluon's interface changes between releases, and cache/gluon_attention.py names what moved).

    python3 scripts/probes/probe_gluon_attention.py --heights 378,392,518 --variants pingpong:4,free:4,overlap:3 \
        --json $OUT/gluon.json
    python3 scripts/probes/probe_gluon_attention.py --compile-only   # any Linux machine with Triton: builds for
                                                              # sm_90a, prints registers and shared memory

Why: at head dimension 64 a Hopper SM spends as many cycles on a 64 x 128 block's exponentials as on
its two products, and the production kernel's ~2,200 cycles a block pair are about their sum
(Nsight Compute): they do not overlap. The variants make them overlap in the ways
FlashAttention-3 does:
  - `overlap`: one warpgroup per program (64 queries, two programs per SM, as production); it issues
    block j's q.k^T and block j-1's p.v asynchronously and computes block j's softmax while the p.v runs;
  - `deep`: as `overlap`, one block further ahead: block j+1's q.k^T and block j-1's p.v both run
    during block j's softmax (two score tiles in registers; needs 3 key blocks in flight or more);
  - `pingpong`: cache/gluon_attention.py's kernel, which the engine runs on Hopper: two warpgroups per
    program (128 queries of one head, one program per SM), each as `overlap`, taking turns to issue
    their products (mbarriers), so that one's softmax runs while the other's products do, and a
    third, one-warp partition loading keys and values by TMA for both;
  - `free`: `pingpong` without the turns.
`--ncu`: launch the variants a few times for Nsight Compute (kernels `_gluon_*` and `_pingpong_range_kernel`).
Keys and values arrive by TMA into STAGES buffers, each with an mbarrier; a range's last partial
block is masked as in production (scores -inf, values past the end zeroed).

Timing: CUDA-event timings (triton.testing.do_bench, L2 cleared before each run) of whole tiles (one
program per 64 or 128 queries of one head against every visible key), the Triton kernel and the
variants taking turns for --rounds rounds on the same tensors (the machine drifts within a call),
medians of the rounds; accuracy: max |out - float32 SDPA| / std.
"""

from __future__ import annotations

import argparse
import json

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from stream_recon.cache import gluon_attention
from stream_recon.cache.gluon_attention import (
    _masked_scores,
    _softmax_block,
    tma_load,
    wgmma_layout,
    zeroed_past,
)

HEADS, HEAD_DIM, BLOCK_M, BLOCK_N = 16, 64, 64, 128
LOG2_E = 1.4426950408889634


@gluon.jit
def _load_block(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, block, num_blocks, start, column,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Key block `block` (if it exists) into buffer block % STAGES: keys and values each signal
    their own barrier, so the product with the keys need not wait for the values."""
    buffer = block % STAGES
    present = block < num_blocks
    row = start + block * BLOCK_N
    mbarrier.expect(k_bars.index(buffer), k_desc.block_type.nbytes, pred=present)
    tma_load(k_desc, [row, column], k_bars.index(buffer), k_smem.index(buffer), pred=present)
    mbarrier.expect(v_bars.index(buffer), v_desc.block_type.nbytes, pred=present)
    tma_load(v_desc, [row, column], v_bars.index(buffer), v_smem.index(buffer), pred=present)


@gluon.jit
def _set_up(q_desc, k_desc, v_desc, key_range, num_queries, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr):
    """A one-warpgroup program's tile (64 queries of one head), its buffers and barriers, its queries
    loaded and its first STAGES key blocks on their way."""
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
    tile = gl.program_id(0)
    num_query_blocks = gl.cdiv(num_queries, BLOCK_M)
    row0 = (tile % num_query_blocks) * BLOCK_M
    column = (tile // num_query_blocks) * HEAD_DIM
    start = gl.load(key_range)
    num_keys = gl.load(key_range + 1) - start
    num_blocks = gl.cdiv(num_keys, BLOCK_N)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
    fence_async_shared()
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma_load(q_desc, [row0, column], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        _load_block(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, i, num_blocks, start, column, BLOCK_N, STAGES)
    mbarrier.wait(q_bar, 0)
    return row0, column, start, num_keys, num_blocks, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars


@gluon.jit
def _finish(p, acc, l_i, v_smem, v_bars, q_bar, k_bars, num_keys, num_blocks, row0, column, Out, stride_o,
            num_queries, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, o_layout: gl.constexpr):
    """The last block's p.v (its values past the range's end zeroed: they may be any bits, NaN, and p
    is 0 there), the rows normalised into Out, the barriers invalidated."""
    BLOCK_M: gl.constexpr = acc.shape[0]
    HEAD_DIM: gl.constexpr = acc.shape[1]
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    last = num_blocks - 1
    buffer = last % STAGES
    mbarrier.wait(v_bars.index(buffer), (last // STAGES) & 1)
    limit = num_keys - last * BLOCK_N
    if limit < BLOCK_N:
        zeroed_past(v_smem.index(buffer), limit, v_smem.index(buffer), BLOCK_N)
    acc = warpgroup_mma(p, v_smem.index(buffer), acc)
    out = acc / gl.convert_layout(l_i, o_rows)[:, None]
    rows = row0 + gl.arange(0, BLOCK_M, layout=o_rows)
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(Out + rows[:, None] * stride_o + column + dims[None, :], out.to(Out.dtype.element_ty),
             mask=rows[:, None] < num_queries)
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(i))
        mbarrier.invalidate(v_bars.index(i))


@gluon.jit
def _gluon_range_kernel(q_desc, k_desc, v_desc, Out, key_range, stride_o, num_queries, qk_scale,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        STAGES: gl.constexpr):
    """`overlap`: block j's q.k^T and block j-1's p.v issued asynchronously, block j's softmax beside
    the p.v."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    row0, column, start, num_keys, num_blocks, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars = _set_up(
        q_desc, k_desc, v_desc, key_range, num_queries, BLOCK_M, BLOCK_N, STAGES)

    # block 0: its scores, then its probabilities wait in registers for the next block's turn
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
    s = _masked_scores(s, 0, num_keys, BLOCK_N, s_layout)
    m_i = gl.max(s, 1) * qk_scale
    p_f32 = gl.exp2(s * qk_scale - m_i[:, None])
    l_i = gl.sum(p_f32, 1)
    p = gl.convert_layout(p_f32.to(gl.bfloat16), p_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)

    for block in range(1, num_blocks):
        buffer = block % STAGES
        previous = (block - 1) % STAGES
        mbarrier.wait(k_bars.index(buffer), (block // STAGES) & 1)
        s_token = warpgroup_mma(q_smem, k_smem.index(buffer).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bars.index(previous), ((block - 1) // STAGES) & 1)
        acc_token = warpgroup_mma(p, v_smem.index(previous), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_token, ))  # the products finish in order
        # this block's softmax while the previous block's p.v runs
        s = _masked_scores(s, block, num_keys, BLOCK_N, s_layout)
        p_f32, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, qk_scale)
        acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc_token, p))
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        p = gl.convert_layout(p_f32.to(gl.bfloat16), p_layout)
        # the previous block's buffer is free: its keys were read by the last product, its values by this one
        _load_block(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, block - 1 + STAGES, num_blocks, start, column,
                    BLOCK_N, STAGES)
    _finish(p, acc, l_i, v_smem, v_bars, q_bar, k_bars, num_keys, num_blocks, row0, column, Out, stride_o,
            num_queries, BLOCK_N, STAGES, o_layout)


@gluon.jit
def _gluon_deep_kernel(q_desc, k_desc, v_desc, Out, key_range, stride_o, num_queries, qk_scale,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       STAGES: gl.constexpr):
    """`deep`: as `overlap`, one block deeper: while block j's softmax runs, the tensor cores hold
    both block j+1's q.k^T and block j-1's p.v (two score tiles live in registers)."""
    s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
    o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    row0, column, start, num_keys, num_blocks, q_smem, k_smem, v_smem, q_bar, k_bars, v_bars = _set_up(
        q_desc, k_desc, v_desc, key_range, num_queries, BLOCK_M, BLOCK_N, STAGES)

    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    mbarrier.wait(k_bars.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False)
    m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    p = gl.zeros([BLOCK_M, BLOCK_N], gl.bfloat16, p_layout)  # block -1's: adds nothing
    mbarrier.wait(v_bars.index(0), 0)  # block -1's product reads block 0's values (finite) times 0

    # blocks [0, num_blocks - 1): whole (only the last can be partial); s holds block j's scores
    for block in range(0, num_blocks - 1):
        following = (block + 1) % STAGES
        mbarrier.wait(k_bars.index(following), ((block + 1) // STAGES) & 1)
        s_token = warpgroup_mma(q_smem, k_smem.index(following).permute((1, 0)), s_zero, use_acc=False,
                                is_async=True)
        previous = gl.maximum(block - 1, 0)
        mbarrier.wait(v_bars.index(previous % STAGES), (previous // STAGES) & 1)
        acc_token = warpgroup_mma(p, v_smem.index(previous % STAGES), acc, is_async=True)
        p_f32, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, qk_scale)
        s, acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(s_token, acc_token, p))
        acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
        p = gl.convert_layout(p_f32.to(gl.bfloat16), p_layout)
        # block j-1's buffer is free (its keys and values read): block j-1+STAGES into it
        _load_block(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, block - 1 + STAGES,
                    gl.where(block >= 1, num_blocks, 0), start, column, BLOCK_N, STAGES)

    last = num_blocks - 1
    previous = gl.maximum(last - 1, 0)
    mbarrier.wait(v_bars.index(previous % STAGES), (previous // STAGES) & 1)
    acc_token = warpgroup_mma(p, v_smem.index(previous % STAGES), acc, is_async=True)
    s = _masked_scores(s, last, num_keys, BLOCK_N, s_layout)
    p_f32, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, qk_scale)
    acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc_token, p))
    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
    p = gl.convert_layout(p_f32.to(gl.bfloat16), p_layout)
    _finish(p, acc, l_i, v_smem, v_bars, q_bar, k_bars, num_keys, num_blocks, row0, column, Out, stride_o,
            num_queries, BLOCK_N, STAGES, o_layout)


# the probe's own one-warpgroup kernels; `pingpong` and `free` run gluon_attention's, turns on and off
KERNELS = {"overlap": _gluon_range_kernel, "deep": _gluon_deep_kernel}
VARIANTS = (*KERNELS, "pingpong", "free")


def gluon_attend_range(q, keys, values, key_range, stages: int = 3, variant: str = "overlap"):
    """q [T, H, D] (contiguous), keys/values [capacity, H, D] -> [T, H, D], whole tiles."""
    import torch

    from stream_recon.cache.triton_attention import TileSchedule

    if variant == "deep" and stages < 3:  # block j+1's keys are loaded into block j-2's buffer
        raise ValueError("the deep kernel needs 3 key blocks in flight or more")
    num_queries, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    qk_scale = head_dim**-0.5 * LOG2_E
    if variant in ("pingpong", "free"):
        tiles = triton.cdiv(num_queries, gluon_attention.TILE_QUERIES) * num_heads
        unused = torch.empty(1, dtype=torch.float32, device=q.device)  # (no pieces)
        gluon_attention.launch(q, keys, values, key_range, out, unused, unused, TileSchedule(tiles, 0, 1), qk_scale,
                               stages=stages, turns=variant == "pingpong")
        return out
    descriptors = [gluon_attention._descriptor(q, BLOCK_M), gluon_attention._descriptor(keys, BLOCK_N),
                   gluon_attention._descriptor(values, BLOCK_N)]
    KERNELS[variant][(triton.cdiv(num_queries, BLOCK_M) * num_heads,)](
        *descriptors, out, key_range, out.stride(0), num_queries, qk_scale, HEAD_DIM=head_dim, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, STAGES=stages, num_warps=4)
    return out


def compile_only(stages: int, variant: str) -> dict:
    """Build the kernel for sm_90 without a GPU; its registers, shared memory and spills."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    q_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], gl.bfloat16)
    signature = {"q_desc": f"tensordesc<bf16[{BLOCK_M}, {HEAD_DIM}],{q_layout}>",
                 "k_desc": f"tensordesc<bf16[{BLOCK_N}, {HEAD_DIM}],{kv_layout}>",
                 "v_desc": f"tensordesc<bf16[{BLOCK_N}, {HEAD_DIM}],{kv_layout}>", "Out": "*bf16"}
    constexprs = {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "STAGES": stages}
    options = {"num_warps": 4}
    if variant in KERNELS:
        kernel = KERNELS[variant]
        signature.update({"key_range": "*i32", "stride_o": "i32", "num_queries": "i32", "qk_scale": "fp32"})
        constexprs["HEAD_DIM"] = HEAD_DIM
    else:  # gluon_attention's kernel, as `launch` calls it
        kernel = gluon_attention._pingpong_range_kernel
        signature.update({"partial_out": "*fp32", "partial_stats": "*fp32", "runs": "*i32", "stride_o": "i32",
                          "num_queries": "i32", "qk_scale": "fp32", "whole_tiles": "i32", "split_tiles": "i32",
                          "splits": "i32", "prefix_share": "i32"})
        constexprs.update(TURNS=variant == "pingpong", CONSUMER_REGS=gluon_attention.CONSUMER_REGISTERS,
                          LOADER_REGS=gluon_attention.LOADER_REGISTERS)
        options["maxnreg"] = gluon_attention.LAUNCH_REGISTERS
    signature.update({name: "constexpr" for name in constexprs})
    compiled = triton.compile(GluonASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options=options)
    return {"variant": variant, "stages": stages, "shared": compiled.metadata.shared,
            **_ptxas_resources(compiled.asm["ptx"])}


def _ptxas_resources(ptx: str) -> dict:
    """Registers and spills as Triton's bundled ptxas reports them for sm_90a."""
    import os
    import re
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        report = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", path + ".o"],
                                capture_output=True, text=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill_stores": int(spills.group(1)) if spills else None}


def _layer(height: int, device):
    """One layer's tensors at a frame size: the frame's queries and scale 8 + window 64 frames of keys
    (specials included) in a store with room to spare, the range starting past zero."""
    import torch

    tokens = (height // 14) * 37 + 5
    num_keys = 72 * tokens
    capacity = num_keys + 3 * tokens
    gen = torch.Generator(device=device).manual_seed(height)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    store = torch.randn(2, capacity, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
    start = 2 * tokens - 17  # not a multiple of the key block: the last block is partial
    key_range = torch.tensor([start, start + num_keys], dtype=torch.int32, device=device)
    return q, store[0], store[1], key_range


def measure(height: int, variants: list[tuple[str, int]], rounds: int) -> dict:
    """Each variant's error, then `rounds` rounds of timings in which the production kernel and the
    variants take turns (the machine drifts by up to ~50 us a layer within a call); their medians."""
    import statistics

    import torch
    import torch.nn.functional as F

    from stream_recon.cache import triton_attention as ta

    device = torch.device("cuda")
    q, keys, values, key_range = _layer(height, device)
    start, end = key_range.tolist()
    ref = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys[start:end].float().transpose(0, 1)[None],
                                         values[start:end].float().transpose(0, 1)[None])[0].transpose(0, 1)
    scale = ref.std().item()
    tiles = triton.cdiv(q.shape[0], BLOCK_M) * HEADS
    whole = ta.TileSchedule(tiles, 0, 1)
    row = {"height": height, "tokens": q.shape[0], "keys": end - start, "tiles": tiles}
    calls = {"production": lambda: ta.attend_range_scheduled(q, keys, values, key_range, tiles, schedule=whole,
                                                             num_stages=ta.NUM_STAGES, tma=True)}
    for variant, stages in variants:
        calls[f"{variant}{stages}"] = (lambda variant=variant, stages=stages:
                                       gluon_attend_range(q, keys, values, key_range, stages, variant))
    for name, call in calls.items():
        out = call()
        row[f"{name}_err"] = (out.float() - ref).abs().max().item() / scale
        row[f"{name}_nan"] = bool(torch.isnan(out).any().item())
    timings = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            timings[name].append(triton.testing.do_bench(call, warmup=25, rep=150) * 1000)
    for name, values_us in timings.items():
        row[f"{name}_us"] = statistics.median(values_us)
        row[f"{name}_rounds_us"] = [round(v, 1) for v in values_us]
    print(height, {name: round(row[f"{name}_us"], 1) for name in calls}, flush=True)
    return row


def _launch_for_profiler(height: int, variants: list[tuple[str, int]]) -> None:
    import torch

    q, keys, values, key_range = _layer(height, torch.device("cuda"))
    for variant, stages in variants:
        for _ in range(3):
            gluon_attend_range(q, keys, values, key_range, stages, variant)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heights", default="378", help="input heights (width 518), comma-separated")
    parser.add_argument("--variants", default="pingpong:4,free:4,overlap:3",
                        help=f"kernels ({', '.join(VARIANTS)}) and their key blocks in flight, NAME:STAGES "
                             "comma-separated")
    parser.add_argument("--compile-only", action="store_true", help="build for sm_90 without a GPU and stop")
    parser.add_argument("--ncu", action="store_true",
                        help="launch each variant three times at the first height and stop (for Nsight Compute)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of timings, the kernels taking turns")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    variants = [(name, int(stages)) for name, stages in (v.split(":") for v in args.variants.split(","))]
    if args.ncu:
        _launch_for_profiler(int(args.heights.split(",")[0]), variants)
        return
    if args.compile_only:
        rows = [compile_only(stages, name) for name, stages in variants]
    else:
        rows = [measure(int(h), variants, args.rounds) for h in args.heights.split(",")]
    for row in rows:
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
