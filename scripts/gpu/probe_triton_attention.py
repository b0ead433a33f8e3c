"""Can a Triton kernel beat cuDNN on the global attention's shape (1005 queries, ~72,000 keys, 16
heads of 64, bf16, keys read in place from the token-major store)?

Sweeps (--sweep): `exp`, pointer loads with float32 exponentials or exponentials two at a time in
half precision (`ex2.approx.f16x2`), since at head dim 64 the exponentials cost as much as the
two matrix products; `loads`, pointer loads against TMA descriptors (and warp specialisation);
`overlap`, TMA loads with the next block's q @ k issued early and lazy rescaling. The key range
comes from device memory, as it would inside a CUDA graph. The block update shared by the plain
variants is the product kernel's (stream_recon.cache.triton_attention).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from stream_recon.cache.triton_attention import LOG2_E, _fold_block

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import time_ms  # noqa: E402

H, D, T = 16, 64, 1005
SPECIALS, PATCHES = 6 * 152, 72 * 999


@triton.jit
def _exp2_f16x2(x):
    return tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x], dtype=tl.float16, is_pure=True,
                                     pack=2)


@triton.jit
def _attend(q, k, v, m_i, l_i, acc, qk_scale, EXP: tl.constexpr, ONES: tl.constexpr):
    s = tl.dot(q, k)  # [M, N] fp32
    if EXP == 0:  # fp32 exponentials, P rounded to bf16 for the second product
        return _fold_block(s, v, m_i, l_i, acc, qk_scale)
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    x = s * qk_scale - m_new[:, None]
    alpha = tl.math.exp2(m_i - m_new)
    if EXP == 1:  # f16x2 exponentials, P converted to bf16
        p = _exp2_f16x2(x.to(tl.float16))
        l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    else:  # f16x2 exponentials, V converted to fp16, row sums on the tensor cores
        p = _exp2_f16x2(x.to(tl.float16))
        pv = tl.dot(p, v.to(tl.float16))
        l_i = l_i * alpha + tl.max(tl.dot(p, ONES), 1)
        acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def attention_kernel(Q, K, V, Out, LSE, key_range, stride_qt, stride_kt, stride_ot, num_queries, qk_scale,
                     HEAD_DIM: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, EXP: tl.constexpr):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(key_range)
    end = tl.load(key_range + 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + offs_m[:, None] * stride_qt + head * HEAD_DIM + offs_d[None, :],
                mask=offs_m[:, None] < num_queries, other=0.0)
    k_ptrs = K + head * HEAD_DIM + (start + offs_n)[None, :].to(tl.int64) * stride_kt + offs_d[:, None]  # [D, N]
    v_ptrs = V + head * HEAD_DIM + (start + offs_n)[:, None].to(tl.int64) * stride_kt + offs_d[None, :]  # [N, D]
    ONES = tl.full([BLOCK_N, 16], 1.0, tl.float16)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    num_keys = end - start
    full = num_keys // BLOCK_N * BLOCK_N
    for n in range(0, full, BLOCK_N):
        k = tl.load(k_ptrs + n * stride_kt)
        v = tl.load(v_ptrs + n * stride_kt)
        m_i, l_i, acc = _attend(q, k, v, m_i, l_i, acc, qk_scale, EXP, ONES)
    if full < num_keys:
        inside = (full + offs_n) < num_keys
        k = tl.load(k_ptrs + full * stride_kt, mask=inside[None, :], other=0.0)
        v = tl.load(v_ptrs + full * stride_kt, mask=inside[:, None], other=0.0)
        # -inf scores for the keys past the end: the bias makes their weights exactly zero
        s = tl.where(inside[None, :], tl.dot(q, k), -float("inf"))
        m_i, l_i, acc = _fold_block(s, v, m_i, l_i, acc, qk_scale)
    acc = acc / l_i[:, None]
    rows = offs_m < num_queries
    tl.store(Out + offs_m[:, None] * stride_ot + head * HEAD_DIM + offs_d[None, :], acc.to(Out.dtype.element_ty),
             mask=rows[:, None])
    tl.store(LSE + head * num_queries + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=rows)


# 2^x for x <= 0 on the FMA and integer pipes instead of the special-function unit (MUFU), whose
# exponentials (one per score) bound attention at head dim 64: round x to j (adding 1.5 * 2^23 leaves
# j in the low mantissa bits), 2^(x - j) by a degree-3 polynomial on [-0.5, 0.5] (relative error
# 7.5e-5, far below P's bf16 rounding), then j added to the exponent field. Inputs below -125
# (masked keys' -inf) give 2^-125 instead of 0, a difference P's bf16 rounding and the zeroed values
# absorb. (Clamped at -125 so that the exponent field stays positive.)
_POLY_EXP2 = """{{
.reg .f32 r, t, j, f, p;
.reg .b32 tb, pb;
max.ftz.f32 r, {x}, 0fC2FA0000;
add.rn.ftz.f32 t, r, 0f4B400000;
sub.rn.ftz.f32 j, t, 0f4B400000;
sub.rn.ftz.f32 f, r, j;
fma.rn.ftz.f32 p, f, 0f3D61FBB0, 0f3E786F0F;
fma.rn.ftz.f32 p, p, f, 0f3F31798D;
fma.rn.ftz.f32 p, p, f, 0f3F7FFB49;
mov.b32 tb, t;
shl.b32 tb, tb, 23;
mov.b32 pb, p;
add.s32 {y}, pb, tb;
}}"""


def _mixed_exp2_asm(pack: int, polynomial: int) -> str:
    """Inline PTX for `pack` consecutive elements: the first pack - polynomial on the MUFU, the rest
    by the polynomial."""
    lines = []
    for i in range(pack):
        x, y = f"${pack + i}", f"${i}"
        lines.append(f"ex2.approx.ftz.f32 {y}, {x};" if i < pack - polynomial else _POLY_EXP2.format(x=x, y=y))
    return "\n".join(lines)


@triton.jit
def _exp2_mixed(x, POLY: tl.constexpr):
    """POLY 1: one element in two by the polynomial; 2: one in four; 3: three in four; 4: none (the
    inline-assembly control)."""
    if POLY == 4:
        return tl.inline_asm_elementwise(MIXED_0_OF_2, "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True, pack=2)
    if POLY == 1:
        return tl.inline_asm_elementwise(MIXED_1_OF_2, "=r,=r,r,r", [x], dtype=tl.float32, is_pure=True, pack=2)
    elif POLY == 2:
        return tl.inline_asm_elementwise(MIXED_1_OF_4, "=r,=r,=r,=r,r,r,r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=4)
    else:
        return tl.inline_asm_elementwise(MIXED_3_OF_4, "=r,=r,=r,=r,r,r,r,r", [x], dtype=tl.float32,
                                         is_pure=True, pack=4)


MIXED_0_OF_2 = tl.constexpr(_mixed_exp2_asm(2, 0))
MIXED_1_OF_2 = tl.constexpr(_mixed_exp2_asm(2, 1))
MIXED_1_OF_4 = tl.constexpr(_mixed_exp2_asm(4, 1))
MIXED_3_OF_4 = tl.constexpr(_mixed_exp2_asm(4, 3))


@triton.jit
def _fold_mixed(s, v, m_i, l_i, acc, qk_scale, POLY: tl.constexpr):
    """The product kernel's block update with part of the exponentials on the FMA pipes."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = _exp2_mixed(s * qk_scale - m_new[:, None], POLY)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _fold(s, v, m_i, l_i, acc, qk_scale, LAZY: tl.constexpr, POLY: tl.constexpr = 0):
    if POLY:
        return _fold_mixed(s, v, m_i, l_i, acc, qk_scale, POLY)
    if LAZY:  # keep a stale maximum until some row grows past it by 2^8 (exact: l and acc share it)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if tl.max(m_new - m_i, 0) > 8.0:
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc = acc * alpha[:, None]
            m_i = m_new
        p = tl.math.exp2(s * qk_scale - m_i[:, None])
        l_i = l_i + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc)
        return m_i, l_i, acc
    return _fold_block(s, v, m_i, l_i, acc, qk_scale)


@triton.jit
def attention_kernel_tma(Q, k_desc, v_desc, Out, key_range, stride_qt, stride_ot, num_queries, qk_scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr,
                         PIPE: tl.constexpr, LAZY: tl.constexpr, POLY: tl.constexpr):
    """Keys and values through tensor-memory-accelerator descriptors of the [capacity, H * D] store.
    WS: warp specialisation of the key loop. PIPE: the next block's q @ k is issued before this
    block's softmax (FlashAttention-3's intra-warpgroup overlap, written by hand). LAZY: rescale
    only when the maximum grows a lot."""
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(key_range)
    end = tl.load(key_range + 1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    col = head * HEAD_DIM
    q = tl.load(Q + offs_m[:, None] * stride_qt + col + offs_d[None, :], mask=offs_m[:, None] < num_queries, other=0.0)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    num_keys = end - start
    full = num_keys // BLOCK_N * BLOCK_N
    if PIPE:
        if full > 0:
            s = tl.dot(q, tl.trans(k_desc.load([start, col])))
            for n in range(BLOCK_N, full, BLOCK_N):
                s_next = tl.dot(q, tl.trans(k_desc.load([start + n, col])))
                m_i, l_i, acc = _fold(s, v_desc.load([start + n - BLOCK_N, col]), m_i, l_i, acc, qk_scale, LAZY)
                s = s_next
            m_i, l_i, acc = _fold(s, v_desc.load([start + full - BLOCK_N, col]), m_i, l_i, acc, qk_scale, LAZY)
    else:
        for n in tl.range(0, full, BLOCK_N, warp_specialize=WS):
            s = tl.dot(q, tl.trans(k_desc.load([start + n, col])))
            m_i, l_i, acc = _fold(s, v_desc.load([start + n, col]), m_i, l_i, acc, qk_scale, LAZY, POLY)
    if full < num_keys:
        inside = (full + offs_n) < num_keys
        s = tl.where(inside[None, :], tl.dot(q, tl.trans(k_desc.load([start + full, col]))), -float("inf"))
        v = tl.where(inside[:, None], v_desc.load([start + full, col]), 0.0)
        m_i, l_i, acc = _fold(s, v, m_i, l_i, acc, qk_scale, False)
    acc = acc / l_i[:, None]
    rows = offs_m < num_queries
    tl.store(Out + offs_m[:, None] * stride_ot + col + offs_d[None, :], acc.to(Out.dtype.element_ty), mask=rows[:, None])


def triton_attention_tma(q, store_k, store_v, key_range, config):
    """config: (block_m, block_n, warps, stages, (warp_specialize, early q @ k, lazy rescaling[, poly]))."""
    block_m, block_n, warps, stages, flags = config
    ws, pipe, lazy, poly = (*flags, 0)[:4]
    out = torch.empty_like(q)
    flat = [t.flatten(1) for t in (store_k, store_v)]  # [capacity, H * D] views
    k_desc, v_desc = (TensorDescriptor(t, list(t.shape), list(t.stride()), [block_n, D]) for t in flat)
    grid = (triton.cdiv(q.shape[0], block_m), H)
    LAST_COMPILED["tma"] = attention_kernel_tma[grid](q, k_desc, v_desc, out, key_range, q.stride(0), out.stride(0), q.shape[0],
                               D ** -0.5 * LOG2_E, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, WS=ws, PIPE=pipe,
                               LAZY=lazy, POLY=poly, num_warps=warps, num_stages=stages)
    return out, None


def triton_attention(q, store_k, store_v, key_range, config):
    """q [T, H, D]; store_* [capacity, H, D]; key_range int32 [2] on the device."""
    out = torch.empty_like(q)
    lse = torch.empty(H, q.shape[0], device=q.device, dtype=torch.float32)
    block_m, block_n, warps, stages, exp = config
    grid = (triton.cdiv(q.shape[0], block_m), H)
    attention_kernel[grid](q, store_k, store_v, out, lse, key_range, q.stride(0), store_k.stride(0), out.stride(0),
                           q.shape[0], D ** -0.5 * LOG2_E, HEAD_DIM=D, NUM_HEADS=H, BLOCK_M=block_m,
                           BLOCK_N=block_n, EXP=exp, num_warps=warps, num_stages=stages)
    return out, lse


RUNNERS = {"ptr": triton_attention, "tma": triton_attention_tma}
LAST_COMPILED: dict = {}  # the last compiled kernel per runner, for its PTX


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--sweep", choices=["exp", "loads", "overlap", "poly"], default="loads",
                        help="exp: fp32 vs f16x2 exponentials; loads: pointer vs TMA loads, key block sizes; "
                        "overlap: next block's q @ k issued early, lazy rescaling; poly: exponentials partly by "
                        "a polynomial on the FMA pipes")
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "triton_attention.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    capacity = SPECIALS + PATCHES + 4096
    store = torch.randn(2, capacity, H, D, device=dev, dtype=torch.bfloat16)
    store_k, store_v = store[0], store[1]
    q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16) * 2
    start, end = 4096, 4096 + SPECIALS + PATCHES
    flops = 4 * T * (end - start) * H * D
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], store_k[start:end].float().transpose(0, 1)[None],
        store_v[start:end].float().transpose(0, 1)[None])[0].transpose(0, 1)
    results = {"triton": triton.__version__, "torch": torch.__version__, "device": torch.cuda.get_device_name()}

    def cudnn_patches():
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            q.transpose(0, 1)[None], store_k[start + SPECIALS:end].transpose(0, 1)[None],
            store_v[start + SPECIALS:end].transpose(0, 1)[None], None, True)[:2]

    cudnn_ms = time_ms(cudnn_patches, args.repeats)
    results["cudnn_patches_ms"] = cudnn_ms
    print(f"cuDNN, patch keys only ({PATCHES}): {cudnn_ms * 1000:.1f} us, "
          f"{4 * T * PATCHES * H * D / cudnn_ms / 1e9:.0f} TFLOP/s", flush=True)
    key_range = torch.tensor([start, end], device=dev, dtype=torch.int32)
    rows = []
    if args.sweep == "exp":  # pointer loads; exponentials in fp32 (0) or f16x2 (1, 2)
        configs = [("ptr", c) for c in itertools.product((128, 64), (64, 128), (4, 8), (2, 3, 4), (0, 1, 2))
                   if not (c[0] == 64 and c[2] == 8)]
    elif args.sweep == "poly":  # TMA loads; none, 1/4, 1/2 or 3/4 of the exponentials by the polynomial
        flags = [(False, False, False, poly) for poly in (0, 4, 2, 1, 3)]
        configs = [("tma", c) for c in itertools.product((64,), (128,), (4,), (3,), flags)]
    elif args.sweep == "overlap":  # TMA loads: q @ k of the next block issued early, lazy rescaling
        flags = [(False, pipe, lazy) for pipe, lazy in itertools.product((False, True), (False, True))]
        configs = [("tma", c) for c in itertools.product((64,), (128, 64), (4,), (2, 3), flags)]
        configs += [("tma", c) for c in itertools.product((128,), (128,), (8,), (2, 3), flags[2:])]
    else:  # fp32 exponentials: pointer loads vs TMA descriptors (+ warp specialization), larger key blocks
        configs = [("ptr", c + (0,)) for c in itertools.product((64,), (128, 256), (4,), (2, 3, 4))]
        configs += [("ptr", c + (0,)) for c in itertools.product((128,), (128, 256), (8,), (3, 4))]
        flags = [(ws, False, False) for ws in (False, True)]
        configs += [("tma", c) for c in itertools.product((64,), (64, 128, 256), (4,), (2, 3, 4), flags)]
        configs += [("tma", c) for c in itertools.product((128,), (128,), (8,), (2, 3), flags)]
    for kind, config in configs:
        block_m, block_n, warps, stages, variant = config
        run = RUNNERS[kind]
        try:
            out, lse = run(q, store_k, store_v, key_range, config)
            torch.cuda.synchronize()
            err = (out.float() - expected).abs().max().item()
            ms = time_ms(lambda run=run, config=config: run(q, store_k, store_v, key_range, config), args.repeats)
        except Exception as error:  # a configuration that does not compile or fit is skipped
            print(f"{kind} {config}: {type(error).__name__}: {str(error)[:200]}", flush=True)
            continue
        if kind in LAST_COMPILED:  # which exponential instructions the kernel's PTX has
            ptx = LAST_COMPILED[kind].asm["ptx"]
            print("  ptx:", {op: ptx.count(op) for op in ("ex2.approx.f32", "ex2.approx.ftz.f32", "fma.rn", "cvt.rn.bf16x2")})
        row = {"kind": kind, "block_m": block_m, "block_n": block_n, "warps": warps, "stages": stages,
               "variant": variant, "us": ms * 1000, "tflops": flops / ms / 1e9, "max_err": err}
        rows.append(row)
        print(f"{kind} {config}: {ms * 1000:.1f} us, {row['tflops']:.0f} TFLOP/s (all {end - start} keys), "
              f"max err {err:.2e}", flush=True)
    rows.sort(key=lambda r: r["us"])
    results["configs"] = rows
    if rows:
        best = rows[0]
        config = (best["block_m"], best["block_n"], best["warps"], best["stages"], best["variant"])
        run = RUNNERS[best["kind"]]
        out, lse = run(q, store_k, store_v, key_range, config)
        if lse is not None:
            scores = (q.float().transpose(0, 1) @ store_k[start:end].float().permute(1, 2, 0)) / math.sqrt(D)
            results["best_lse_err"] = (lse - torch.logsumexp(scores, -1)).abs().max().item()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(q, store_k, store_v, key_range, config)
        results["best_in_graph_us"] = time_ms(graph.replay, args.repeats) * 1000
        print(f"best {best['kind']} {config}: in a graph {results['best_in_graph_us']:.1f} us")
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
