"""The fp8 (e4m3) K/V store on the CPU: the quantisation rule against float64, the store following
the page tables (rollbacks and growth keep the scales), the backend table's fp8 column, the
write kernel and the fp8 range kernel under Triton's interpreter, and the tiny model streaming over
an fp8 cache. `pytest -k fp8` selects them. The GPU runs the kernels in tests/test_gpu_fp8.py."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch
from cache_reference import OPS, layouts
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_interpreter import interpret

from stream_recon.cache import CacheLayout, PagedKV, PagedTwoStreamCache, PagePool, backends, fp8

E4M3 = torch.float8_e4m3fn
CPU = torch.device("cpu")
MANTISSA_ERROR = 2.0**-4  # e4m3 keeps 3 mantissa bits: nearest rounding is off by half a step at most
SUBNORMAL_STEP = 2.0**-9  # e4m3's smallest step (its subnormals), in units of the scale


@st.composite
def head_vectors(draw):
    """[T, H, D] float64 vectors whose magnitudes span many binades, some all zero."""
    tokens, heads, dim = draw(st.integers(1, 6)), draw(st.integers(1, 3)), draw(st.sampled_from([1, 8, 64]))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, dim, generator=generator, dtype=torch.float64)
    # Per-vector magnitudes from 2^-30 to 2^30, and a wide spread inside each vector.
    x *= 2.0 ** torch.randint(-30, 31, (tokens, heads, 1), generator=generator)
    x *= 2.0 ** torch.randint(-12, 1, (tokens, heads, dim), generator=generator)
    zero_rows = torch.rand(tokens, heads, generator=generator) < 0.2
    x[zero_rows] = 0.0
    return x


@settings(max_examples=200, deadline=None)
@given(x=head_vectors())
def test_fp8_round_trip_is_within_e4m3_error_of_float64(x):
    codes, exponents = fp8.quantize(x)
    assert codes.dtype == E4M3 and exponents.dtype == torch.int8 and exponents.shape == x.shape[:-1]
    scale = fp8.exponent_scale(exponents).double()[..., None]
    back = fp8.dequantize(codes, exponents, torch.float64)
    assert torch.isfinite(back).all()
    # float32 input rounding (2^-24) + e4m3 rounding: relative for normal codes, one step below
    bound = MANTISSA_ERROR * (1 + 2.0**-20) * x.abs() + SUBNORMAL_STEP / 2 * scale
    assert ((back - x).abs() <= bound).all()
    # the scale is the smallest power of two that keeps the vector in range (448 * 2^e >= amax >
    # 224 * 2^e), so the largest code uses the top binade, unless the exponent is at its floor
    amax = x.float().abs().amax(-1).double()
    largest = codes.float().abs().amax(-1).double()
    unclamped = exponents.int() > fp8.MIN_EXPONENT
    assert (largest <= fp8.E4M3_MAX).all() and (largest[unclamped] >= fp8.E4M3_MAX / 2).all()
    assert (fp8.E4M3_MAX * scale[..., 0] >= amax).all()
    assert (fp8.E4M3_MAX / 2 * scale[..., 0][unclamped] < amax[unclamped]).all()


def test_fp8_zeros_saturation_and_exact_powers():
    x = torch.zeros(4, 1, 8)
    x[1, 0, 0] = 448.0 * 2.0**5  # exactly representable at the top of the range
    x[2, 0, :] = torch.tensor([1.0, -3.0, 0.0, 2.0**-20, 460.0, -479.0, 0.5, 7.0])
    x[3, 0, 0] = 448.0 * 2.0**5 * (1 + 2.0**-20)  # just above: the next exponent
    codes, exponents = fp8.quantize(x)
    assert exponents.tolist() == [[fp8.MIN_EXPONENT], [5], [1], [6]]
    assert codes[0].float().abs().max() == 0  # a zero vector stays zero
    assert codes[1, 0, 0].float() == 448.0  # no rounding past the largest code, no NaN
    assert not torch.isnan(codes.float()).any()
    back = fp8.dequantize(codes, exponents, torch.float32)
    assert back[1, 0, 0] == 448.0 * 2**5
    # 2^-20 is far below this vector's scale (2^1): it becomes 0, within half a subnormal step
    assert back[2, 0, 3] == 0.0


def test_fp8_dequantized_values_are_exact_in_bf16():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 64, generator=generator) * 2.0 ** torch.randint(-40, 40, (50, 4, 1), generator=generator)
    codes, exponents = fp8.quantize(x)
    exact = fp8.dequantize(codes, exponents, torch.float64)
    assert torch.equal(fp8.dequantize(codes, exponents, torch.bfloat16).double(), exact)
    assert torch.equal(fp8.dequantize(codes, exponents, torch.float32).double(), exact)


def test_fp8_exponents_match_the_smallest_power_of_two():
    amax = torch.tensor([0.0, 1e-42, 2.0**-140, 3.0, 448.0, 448.0001, 447.99, 448 * 2.0**-7, 1e30])
    exponents = fp8.scale_exponents(amax).int()
    expected = [max(fp8.MIN_EXPONENT, int(np.ceil(np.log2(a / 448.0)))) if a > 0 else fp8.MIN_EXPONENT
                for a in amax.double().tolist()]
    assert exponents.tolist() == expected


# -- the pages --------------------------------------------------------------------------------------
def test_fp8_pages_take_half_the_bytes_plus_one_per_head_vector():
    bf16 = PagedKV(3, 4, 64, 10, torch.bfloat16, CPU, num_pages=10)
    quantized = PagedKV(3, 4, 64, 10, torch.bfloat16, CPU, num_pages=10, store_dtype=E4M3)
    assert quantized.quantized and not bf16.quantized
    assert quantized.dtype == torch.bfloat16 and quantized.store_dtype == E4M3  # attention stays bf16
    assert bf16.bytes_allocated == 3 * 2 * 100 * 4 * 64 * 2
    assert quantized.bytes_allocated == 3 * 2 * 100 * 4 * 64 + 3 * 2 * 4 * 100
    for kv in (bf16, quantized):
        assert kv.bytes_allocated == PagedKV.bytes_needed(3, 4, 64, 10, 10, kv.store_dtype)
    with pytest.raises(ValueError, match="float8_e4m3fn, not torch.float16"):
        PagedKV(1, 1, 8, 4, torch.bfloat16, CPU, num_pages=1, store_dtype=torch.float16)


class TwoStores:
    """One set of page tables driving float64 pages and fp8 pages with the same K/V: the fp8 pages must hold
    the quantised float64 values at every visible key, after every operation, and keep them as the pool
    grows (each layer re-allocated with its exponents)."""

    def __init__(self, layout: CacheLayout, seed: int):
        self.cache = PagedTwoStreamCache(layout, PagePool(2, grow_by=2))
        pages = self.cache.pool.num_pages
        self.exact = PagedKV(2, 2, 8, layout.page_size, torch.float64, CPU, pages)
        self.quantized = PagedKV(2, 2, 8, layout.page_size, torch.float32, CPU, pages, store_dtype=E4M3)
        self.generator = torch.Generator().manual_seed(seed)

    def append(self, defer: bool):
        self.cache.append(defer_eviction=defer)
        for kv in (self.exact, self.quantized):
            kv.ensure_pages(self.cache.pool.num_pages)
        slots = torch.tensor(self.cache.token_slots(-1))
        for layer in range(2):
            scale = 2.0 ** torch.randint(-8, 9, (len(slots), 2, 1), generator=self.generator)
            k, v = (torch.randn(len(slots), 2, 8, generator=self.generator, dtype=torch.float64) * scale
                    for _ in range(2))
            self.exact.write(layer, slots, k, v)
            self.quantized.write(layer, slots, k, v)

    def check(self):
        rows = self.exact.visible_rows(self.cache.visible_pages())
        for layer in range(2):
            exact, ours = self.exact.gather(layer, rows), self.quantized.gather(layer, rows)
            for reference, got in zip(exact, ours, strict=True):
                assert got.dtype == torch.float32
                assert torch.equal(got.double(), fp8.dequantize(*fp8.quantize(reference), torch.float64))


@settings(max_examples=100, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 1000), scale_batch=st.integers(1, 3), ops=st.lists(OPS, max_size=20))
@pytest.mark.slow
def test_fp8_pages_follow_appends_rollbacks_and_growth(layout, seed, scale_batch, ops):
    stores = TwoStores(layout, seed)
    for _ in range(scale_batch):
        stores.append(defer=False)
    stores.cache.commit()
    stores.check()
    for op in ops:
        stores.append(defer=op.startswith("defer"))
        stores.check()
        if op in ("key", "defer_commit"):
            stores.cache.commit()
        else:
            stores.cache.rollback()
        stores.check()


# -- the backend table -----------------------------------------------------------------------------
def test_fp8_precision_names():
    assert backends.store_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert backends.store_dtype("bf16", torch.bfloat16) == torch.bfloat16
    assert backends.store_dtype("fp8", torch.bfloat16) == E4M3
    assert backends.store_dtype("fp8", torch.float32) == E4M3
    assert [backends.precision_name(d) for d in (torch.bfloat16, torch.float32, E4M3)] == ["bf16", "fp32", "fp8"]
    with pytest.raises(ValueError, match="unknown K/V cache precision 'bf16' for a fp32 model: use auto"):
        backends.store_dtype("bf16", torch.float32)


def test_fp8_is_read_by_the_range_kernel_and_the_sdpa_reference():
    assert {name for name in backends.names()[1:] if backends.spec(name).reads_fp8} == {"sdpa", "triton"}
    assert backends.resolve("auto", CPU, torch.float32, E4M3).name == "sdpa"
    assert backends.resolve("auto", CPU, torch.float32).name == "sdpa"


# -- kernels under Triton's interpreter ------------------------------------------------------------
WRITE_SCRIPT = textwrap.dedent("""
    import sys, torch
    from stream_recon.cache import fp8
    from stream_recon.cache.triton_store import write_quantized

    for seed, heads, capacity in eval(sys.argv[1]):
        generator = torch.Generator().manual_seed(seed)
        tokens = 7
        qkv = torch.randn(tokens, 3, heads, 64, generator=generator)  # k, v: strided views, as a block makes them
        qkv *= 2.0 ** torch.randint(-20, 20, (tokens, 3, heads, 1), generator=generator)
        qkv[0, 1, 0] = 0.0
        qkv[1, 2, :, :4] = torch.tensor([448.0, -448.0, 224.0, 0.5])  # exact powers and the top of the range
        qkv[2, 1, :, :8] = torch.arange(8) * 2.0**-9 + 2.0**-10  # ties between e4m3's smallest steps
        k, v = qkv[:, 1].bfloat16() if seed % 2 else qkv[:, 1], qkv[:, 2]
        codes = torch.zeros(2, capacity, heads, 64, dtype=torch.float8_e4m3fn)
        exponents = torch.zeros(2, heads, capacity, dtype=torch.int8)
        slots = torch.randperm(capacity, generator=generator)[:tokens]
        write_quantized(codes, exponents, slots, k, v)
        for which, x in enumerate((k, v)):
            expected_codes, expected_exponents = fp8.quantize(x)
            assert torch.equal(codes[which, slots].view(torch.uint8), expected_codes.view(torch.uint8)), (seed, which)
            assert torch.equal(exponents[which][:, slots], expected_exponents.transpose(0, 1)), (seed, which)
        untouched = torch.ones(capacity, dtype=torch.bool)
        untouched[slots] = False
        assert codes[:, untouched].view(torch.uint8).eq(0).all() and exponents[:, :, untouched].eq(0).all()
    print("ok")
""")


@pytest.mark.slow
def test_fp8_write_kernel_stores_the_bytes_of_the_torch_rule():
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")
    assert interpret(WRITE_SCRIPT, [(0, 2, 11), (1, 3, 9), (2, 16, 7)]).strip() == "ok"


ATTENTION_SCRIPT = textwrap.dedent("""
    import sys, torch
    import torch.nn.functional as F
    from stream_recon.cache import PagedKV, VisiblePages
    from stream_recon.cache.backends.triton import TritonPagedAttention

    torch.manual_seed(0)
    worst = []
    for page_ids, last, queries in eval(sys.argv[1]):
        kv = PagedKV(num_layers=2, num_heads=2, head_dim=32, page_size=40, dtype=torch.float32, device="cpu",
                     num_pages=8, store_dtype=torch.float8_e4m3fn)
        for layer in range(2):  # K/V whose magnitudes differ per token, as the model's do
            k, v = (torch.randn(320, 2, 32) * 2.0 ** torch.randint(-6, 4, (320, 2, 1)) for _ in range(2))
            kv.write(layer, torch.arange(320), k, v)
        visible = VisiblePages(page_ids=tuple(page_ids), last_page_len=last, page_size=40, num_scale_pages=1,
                               num_window_pages=len(page_ids) - 1, num_special_pages=0, num_special_tokens=0)
        backend = TritonPagedAttention(kv, schedule_keys=kv.num_rows)
        backend.plan(visible, queries)
        q = torch.randn(queries, 2, 32) * 2
        out = backend.attend(1, q)
        keys, values = kv.gather(1, kv.visible_rows(visible))  # dequantised: the values the kernel stands for
        # the kernel reads the dequantised buffer, in the pages' compute dtype (float32 here)
        expected = F.scaled_dot_product_attention(q.transpose(0, 1)[None],
            keys.float().transpose(0, 1)[None], values.float().transpose(0, 1)[None])[0].transpose(0, 1)
        assert out.shape == q.shape and out.dtype == torch.float32
        worst.append(((out - expected).abs().max() / expected.abs().max()).item())
    print(" ".join(f"{w:.3e}" for w in worst))
""")
# Page tables (pages of 40 rows) whose runs end inside the kernel's 128-key blocks, a partial last page, and
# query counts around its 64-row blocks: (page ids in key order, the last page's tokens, queries).
ATTENTION_CASES = [((3,), 4, 3), ((0, 1, 2, 5, 6, 7), 40, 64), ((7, 2, 3, 0), 11, 70), ((1, 2, 3, 4), 9, 130)]


@pytest.mark.slow
def test_fp8_range_kernel_over_pages_matches_sdpa_over_the_dequantised_keys():
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")
    errors = [float(x) for x in interpret(ATTENTION_SCRIPT, ATTENTION_CASES).split()]
    assert len(errors) == len(ATTENTION_CASES)
    for case, error in zip(ATTENTION_CASES, errors, strict=True):
        assert error <= 1e-5, f"pages {case[0]}, {case[2]} queries: relative error {error:.2e}"
