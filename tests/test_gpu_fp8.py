"""The fp8 K/V cache and the memory budget on the GPU: the write and range kernels against PyTorch,
the full model over an fp8 cache against the float32 golden outputs (FP8_TOLERANCE), and a
budgeted run whose peak stays within its plan. Skipped on machines without CUDA.

    pytest -q tests/test_gpu_fp8.py -s -k "not budget"   # -s prints the measured errors
    pytest -q tests/test_gpu_fp8.py -s -k budget         # alone: it holds the whole process to 8 GiB
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from golden_utils import GOLDEN
from gpu_golden import SCENARIOS, as_golden, errors, stream

from stream_recon.cache import PagedKV, VisiblePages, fp8

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E4M3 = torch.float8_e4m3fn
# The fp8 cache's accuracy limits: its outputs against the float32 golden ones, max |o - g| / std(g).
FP8_TOLERANCE = {"depth": 0.25, "depth_conf": 0.25, "pose_enc": 0.5}


def triton_with_e4m3():
    pytest.importorskip("triton", reason="triton is not installed")
    from stream_recon.cache import fp8

    if not fp8.triton_has_e4m3(torch.device("cuda")):
        pytest.skip("our Triton kernels read and write e4m3 codes from compute capability 8.9 on (Ada, Hopper)")


def random_kv(tokens: int, heads: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    """[tokens, heads, dim] whose magnitudes differ per token and head, as the model's K/V do."""
    magnitude = 2.0 ** torch.randint(-6, 4, (tokens, heads, 1), generator=generator)
    return (torch.randn(tokens, heads, dim, generator=generator) * magnitude).cuda().bfloat16()


def test_fp8_write_kernel_stores_each_value_within_one_e4m3_rounding():
    """The Triton write against the PyTorch rule (cache/fp8.py): the same exponents, and every code
    within one e4m3 rounding of its value (the number of codes that differ from PyTorch's cast,
    ties or subnormals, is printed and must stay a tiny fraction)."""
    triton_with_e4m3()
    generator = torch.Generator().manual_seed(0)
    kv = PagedKV(2, 16, 64, 1000, torch.bfloat16, "cuda", num_pages=3, store_dtype=E4M3)
    assert kv._write_kernel is not None  # the Triton write, not the PyTorch one
    slots = torch.randperm(3000, generator=generator)[:1005].cuda()
    qkv = random_kv(1005 * 3, 16, 64, generator).view(1005, 3, 16, 64)  # k, v: strided views of a qkv tensor
    kv.write(1, slots, qkv[:, 1], qkv[:, 2])
    torch.cuda.synchronize()
    for which in range(2):
        source = qkv[:, 1 + which].float().cpu()
        codes, exponents = fp8.quantize(source)
        stored = kv.layers[1][which, slots].cpu()
        stored_exponents = kv.exponents[1][which][:, slots].cpu().transpose(0, 1)
        assert torch.equal(stored_exponents, exponents)
        differing = stored.view(torch.uint8) != codes.view(torch.uint8)
        error = (fp8.dequantize(stored, stored_exponents, torch.float32) - source).abs()
        # half a step of e4m3 at each value (2^-4 relative), or half its smallest subnormal step (2^-9 * 2^e)
        bound = torch.maximum(source.abs() * 2.0**-4, fp8.exponent_scale(stored_exponents)[..., None] * 2.0**-10)
        print(f"{'KV'[which]}: {int(differing.sum())} of {differing.numel()} codes differ from PyTorch's cast; "
              f"worst error {float((error / bound).max()):.3f} of the rounding bound")
        assert (error <= bound * (1 + 1e-6)).all()
        assert differing.float().mean() <= 1e-3


# (pages of `page_size` rows, the visible pages in key order, the last one's tokens, queries): one short page, a
# few pages out of order, and the streaming shape (72 frames' pages of 999 patches and one special page)
FP8_CASES = [(16, (3,), 4, 3), (40, (0, 1, 2, 5, 6, 7), 40, 64), (40, (7, 2, 3, 0), 11, 70),
             (999, (*range(1, 73), 0), 432, 1005)]


@pytest.mark.parametrize(("page_size", "page_ids", "last", "queries"), FP8_CASES)
def test_fp8_range_kernel_over_pages_matches_sdpa_over_the_dequantised_keys(page_size, page_ids, last, queries):
    triton_with_e4m3()
    from stream_recon.cache.backends.triton import TritonPagedAttention

    generator = torch.Generator().manual_seed(page_size * len(page_ids))
    pages = max(page_ids) + 2
    quantized = PagedKV(1, 16, 64, page_size, torch.bfloat16, "cuda", pages, store_dtype=E4M3)
    rows = torch.arange(pages * page_size, device="cuda")
    quantized.write(0, rows, random_kv(len(rows), 16, 64, generator), random_kv(len(rows), 16, 64, generator))
    plain = PagedKV(1, 16, 64, page_size, torch.bfloat16, "cuda", pages)
    everything = quantized.gather(0, rows)  # dequantised bf16: exact
    plain.write(0, rows, *everything)
    visible = VisiblePages(page_ids=page_ids, last_page_len=last, page_size=page_size, num_scale_pages=1,
                           num_window_pages=len(page_ids) - 1, num_special_pages=0, num_special_tokens=0)
    keys, values = quantized.gather(0, quantized.visible_rows(visible))
    q = (torch.randn(queries, 16, 64, generator=generator) * 2).cuda().bfloat16()
    outputs = {}
    for name, kv in (("fp8", quantized), ("bf16", plain)):
        backend = TritonPagedAttention(kv, schedule_keys=kv.num_rows)
        backend.plan(visible, queries)
        outputs[name] = backend.attend(0, q).float()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], keys.float().transpose(0, 1)[None], values.float().transpose(0, 1)[None]
    )[0].transpose(0, 1)
    worst = (outputs["fp8"] - expected).abs().max().item()
    between = (outputs["fp8"] - outputs["bf16"]).abs().max().item()
    print(f"{len(page_ids)} pages of {page_size}, {queries} queries: fp8 pages vs fp32 SDPA {worst:.2e}, vs the bf16 "
          f"pages of the same values {between:.2e}")
    scale = expected.abs().max().item()
    # P and the output are rounded to bf16 (2^-8 relative); bf16 kernels land within 1% of the largest output.
    # The fp8 pages are read through their exact bf16 dequantisation (one range) by the same kernel, the bf16
    # pages through their runs: the same keys, summed in another order.
    assert worst <= 1e-2 * scale and between <= 1e-2 * scale


@pytest.mark.parametrize("attention", ["triton", "sdpa"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_fp8_cache_meets_the_issue_limits_against_golden(gpu_model, scenario, attention):
    """The full model over an fp8 cache (the kernel's reading, and SDPA over dequantised copies):
    depth and confidence within 0.25 sigma, pose within 0.5 sigma of float32, keyframe decisions
    those of the bf16 cache."""
    if attention == "triton":
        triton_with_e4m3()
    golden = np.load(GOLDEN / scenario / "outputs.npz")
    quantized, engine = stream(gpu_model, torch.bfloat16, attention, kv_cache="fp8", **SCENARIOS[scenario])
    assert engine.stats()["kv_cache"] == "fp8" and engine.stats()["attention"].startswith(attention)
    plain, _ = stream(gpu_model, torch.bfloat16, attention, **SCENARIOS[scenario])
    measured, bf16_measured = errors(quantized, golden), errors(plain, golden)
    between = errors(quantized, as_golden(plain))
    print(f"{scenario} {attention}: fp8 vs golden {measured}; bf16 vs golden {bf16_measured}; fp8 vs bf16 {between}")
    types, plain_types = [p.frame_type for p in quantized], [p.frame_type for p in plain]
    assert types == plain_types
    if plain_types == golden["frame_type"].tolist():
        assert types == golden["frame_type"].tolist()
    for key, limit in FP8_TOLERANCE.items():
        assert measured[key] <= limit, f"{key}: {measured[key]:.3f} sigma"


def test_budget_run_peaks_within_its_plan(gpu_model):
    """The 8 GiB setting on the full model: 518x392 frames (a 640x480 video), scale 8, window 64,
    an 8 GiB budget whose allocator is held to what an 8 GiB card leaves beside the CUDA context: the
    plan takes the fp8 cache and, the context counted, a shorter window (51 on an H100,
    saying so), nothing runs out of memory, the measured peak stays under the plan's estimate and the
    allocator's with the context within the budget."""
    from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference
    from stream_recon.models.stream.memory import CUDA_CONTEXT_BYTES, MIN_WINDOW, hold_to_card

    triton_with_e4m3()
    budget = 8 * 2**30
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    already = torch.cuda.memory_allocated()
    assert already < 64 * 2**20, (f"{already / 2**30:.2f} GiB were allocated before this test: run it in a process of "
                                  "its own (pytest tests/test_gpu_fp8.py -k budget)")
    hold_to_card(budget)  # an 8 GiB card's allocator
    try:
        model = prepare_for_inference(gpu_model, "cuda", torch.bfloat16)
        engine = StreamingEngine(model, StreamConfig(scale_frames=8, window=64, gpu_memory=budget,
                                                     max_cached_frames=321))  # as windowed streaming sets it
        generator = torch.Generator().manual_seed(0)
        images = [torch.rand(3, 392, 518, generator=generator).cuda() for _ in range(4)]
        for i in range(200):
            engine.push(images[i % 4])
        engine.finish()
        torch.cuda.synchronize()
        peak, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    plan = engine.memory_plan
    print(plan.describe())
    print(f"measured peak allocated {peak / 2**30:.2f} GiB, reserved {reserved / 2**30:.2f} GiB")
    assert plan.kv_cache == "fp8" and MIN_WINDOW <= plan.window <= 64 and engine.stats()["cuda_graphs"]
    assert plan.window == 64 or "window was shortened from 64" in " ".join(plan.reasons)
    assert engine.cache.bytes_allocated == plan.estimate.kv_cache
    assert peak <= plan.estimate.tensors and reserved + CUDA_CONTEXT_BYTES <= budget
