"""The Triton range kernel (dense-triton) on the CPU, through Triton's interpreter: the same kernel
source the GPU compiles, run block by block in NumPy, against float32 SDPA over the same keys.
The GPU runs it in tests/test_gpu_fast_path.py against the golden fixtures."""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import interpret

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

# Key ranges around the kernel's 128-key blocks: shorter than one, whole blocks, a partial last
# block; query counts around its 64-row blocks. (start, end, queries, dtype)
CASES = [(5, 9, 3, "float16"), (40, 40 + 256, 64, "float16"), (7, 7 + 300, 70, "float32"), (0, 129, 130, "float16")]

SCRIPT = textwrap.dedent("""
    import sys, torch
    import torch.nn.functional as F
    from stream_recon.cache import DenseKV, VisibleRange
    from stream_recon.cache.triton_attention import TritonRangeAttention

    torch.manual_seed(0)
    worst = []
    for start, end, queries, dtype in eval(sys.argv[1]):
        dtype = getattr(torch, dtype)
        kv = DenseKV(num_layers=2, num_heads=2, head_dim=32, capacity=320, dtype=dtype, device="cpu")
        kv.store.copy_(torch.randn_like(kv.store, dtype=torch.float32) * 2)
        backend = TritonRangeAttention(kv)
        backend.plan(VisibleRange(start, end, start), queries)
        q = torch.randn(queries, 2, 32) * 2
        out = backend.attend(1, q)
        keys, values = kv.keys_values(1, start, end)
        expected = F.scaled_dot_product_attention(q.to(dtype).float().transpose(0, 1)[None],
            keys.float().transpose(0, 1)[None], values.float().transpose(0, 1)[None])[0].transpose(0, 1)
        assert out.shape == q.shape and out.dtype == dtype
        worst.append((out.float() - expected).abs().max().item())
    print(" ".join(f"{w:.3e}" for w in worst))
""")


def test_range_kernel_matches_sdpa_over_the_same_keys():
    errors = [float(x) for x in interpret(SCRIPT, CASES).split()]
    assert len(errors) == len(CASES)
    for (start, end, queries, dtype), error in zip(CASES, errors, strict=True):
        # P is rounded to the store's dtype before the second product, as in any fused kernel
        limit = 5e-3 if dtype == "float16" else 1e-5
        assert error <= limit, f"keys [{start}, {end}), {queries} queries, {dtype}: max error {error:.2e}"


def test_mismatched_layouts_are_refused():
    import torch

    from stream_recon.cache.triton_attention import attend_range

    q = torch.zeros(4, 2, 32)
    with pytest.raises(ValueError, match="do not match"):
        attend_range(q, torch.zeros(10, 3, 32), torch.zeros(10, 3, 32), torch.tensor([0, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="head-contiguous"):
        store = torch.zeros(10, 32, 2).transpose(1, 2)  # [10, 2, 32] with the heads innermost
        attend_range(q, store, store, torch.tensor([0, 10], dtype=torch.int32))
