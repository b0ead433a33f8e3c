"""The pages' plain write kernel (cache/triton_store.py) on the CPU, through Triton's
interpreter: the bytes two index_copy_ calls would store, for every dtype the pages
keep besides fp8 (tests/test_cache_fp8.py covers that one). The GPU runs it in every CUDA
test of tests/test_gpu_fast_path.py."""

from __future__ import annotations

import textwrap

import pytest
from triton_interpreter import interpret

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

SCRIPT = textwrap.dedent("""
    import sys, torch
    from stream_recon.cache.triton_store import write

    for seed, heads, capacity, store_dtype, input_dtype in eval(sys.argv[1]):
        generator = torch.Generator().manual_seed(seed)
        tokens = 5
        qkv = torch.randn(tokens, 3, heads, 64, generator=generator).to(getattr(torch, input_dtype))
        k, v = qkv[:, 1].contiguous(), qkv[:, 2]  # v a strided view, as a block hands it over
        store = torch.full((2, capacity, heads, 64), 7.0, dtype=getattr(torch, store_dtype))
        expected = store.clone()
        slots = torch.randperm(capacity, generator=generator)[:tokens]
        write(store, slots, k, v)
        expected[0].index_copy_(0, slots, k.to(expected.dtype))
        expected[1].index_copy_(0, slots, v.to(expected.dtype))
        assert torch.equal(store.view(torch.uint8), expected.view(torch.uint8)), (seed, store_dtype, input_dtype)
    print("ok")
""")


@pytest.mark.slow
def test_plain_write_kernel_stores_what_index_copy_stores():
    cases = [(0, 2, 11, "float32", "float32"), (1, 3, 9, "float16", "float32"), (2, 16, 7, "bfloat16", "bfloat16"),
             (3, 4, 6, "float32", "bfloat16")]
    assert interpret(SCRIPT, cases).strip() == "ok"


def test_writes_that_do_not_fit_the_store_are_refused():
    import torch

    from stream_recon.cache.triton_store import write

    store = torch.zeros(2, 8, 2, 64)
    with pytest.raises(ValueError, match="do not fit"):
        write(store, torch.arange(3), torch.zeros(3, 3, 64), torch.zeros(3, 3, 64))
    with pytest.raises(ValueError, match="D-contiguous"):
        write(store, torch.arange(3), torch.zeros(3, 64, 2).transpose(1, 2), torch.zeros(3, 2, 64))
