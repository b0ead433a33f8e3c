"""Which dense kernel reads a contiguous key range whose length changes every frame, at the
speed of a fixed shape? (cuDNN builds an execution plan per new shape.)"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

H, D, T, N0, PAD = 16, 64, 1005, 72 * 999 + 600, 8192
dev, dt = "cuda", torch.bfloat16
q = torch.randn(T, H, D, device=dev, dtype=dt)
store_k = torch.randn(N0 + 2 * PAD, H, D, device=dev, dtype=dt)
store_v = torch.randn_like(store_k)


def ms(fn, n=20):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t) / n


def reference(start, end):
    return F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], store_k[start:end].float().transpose(0, 1)[None],
                                          store_v[start:end].float().transpose(0, 1)[None])[0].transpose(0, 1)


def sdpa_view(start, end, mask=None):
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], store_k[start:end].transpose(0, 1)[None],
                                          store_v[start:end].transpose(0, 1)[None], attn_mask=mask)[0].transpose(0, 1)


state = {"n": 0}


def growing():  # a new length every call, as specials accumulate
    state["n"] += 6
    return sdpa_view(PAD - state["n"], PAD + N0)


print(f"cudnn fixed shape: {ms(lambda: sdpa_view(PAD, PAD + N0)):.3f} ms")
print(f"cudnn new shape every call: {ms(growing):.3f} ms")
for bucket in (512, 2048):
    def bucketed(bucket=bucket):
        state["n"] += 6
        start, end = PAD - state["n"], PAD + N0
        padded = -(-(end - start) // bucket) * bucket
        mask = (torch.arange(padded, device=dev) < end - start)[None, None, None, :]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa_view(start, start + padded, mask)
    try:
        state["n"] = 0
        out = bucketed()
        start, end = PAD - state["n"], PAD + N0
        err = (out.float() - reference(start, end)).abs().max().item()
        print(f"cudnn bucket {bucket} + bool mask: {ms(bucketed):.3f} ms, max err {err:.4f}")
    except Exception as e:
        print(f"cudnn bucket {bucket} + mask failed: {type(e).__name__}: {str(e)[:300]}")
try:
    cu_q = torch.tensor([0, T], dtype=torch.int32, device=dev)
    def ragged():
        state["n"] += 6
        start, end = PAD - state["n"], PAD + N0
        cu_k = torch.tensor([start, end], dtype=torch.int32, device=dev)
        return torch.ops.aten._cudnn_attention_forward(q, store_k, store_v, None, cu_q, cu_k, T, store_k.shape[0],
                                                       False, 0.0, False, False)[0]
    state["n"] = 0
    out = ragged()
    err = (out.float() - reference(PAD - 6, PAD + N0)).abs().max().item()
    print(f"cudnn ragged (cum_seq_k offsets): {ms(ragged):.3f} ms, max err {err:.4f}")
except Exception as e:
    print(f"cudnn ragged failed: {type(e).__name__}: {str(e)[:400]}")
