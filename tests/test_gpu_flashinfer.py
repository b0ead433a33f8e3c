"""FlashInfer backend on the GPU: the same pages and queries as the SDPA reference (the one-frame step through
its CUDA-graph wrapper, a step of several frames through the other), and the full model on the golden fixtures
in bf16. Skipped on machines without CUDA or flashinfer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from golden_utils import GOLDEN, TOLERANCE
from gpu_golden import BF16_TOLERANCE, SCENARIOS, as_golden, errors, long_stream_tiny_model, stream

from stream_recon.cache import CacheLayout, PagedKV, PagedTwoStreamCache, PagePool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the FlashInfer kernels run on NVIDIA GPUs only)"),
]


@pytest.fixture(scope="module")
def flashinfer_backend():
    pytest.importorskip("flashinfer", reason="flashinfer is not installed (scripts/setup-env on a CUDA machine)")
    from stream_recon.cache.backends.flashinfer import FlashInferPagedAttention

    return FlashInferPagedAttention


@pytest.mark.parametrize("variant", ["fa2", "fa3"])
@pytest.mark.parametrize("page_size, scale, window", [(37, 2, 3), (1, 1, 2), (144, 3, 4), (999, 2, 3)])
def test_flashinfer_matches_sdpa_on_random_sequences(flashinfer_backend, variant, page_size, scale, window):
    from stream_recon.cache.backends.sdpa import SDPAPagedAttention

    if variant == "fa3" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the fa3 kernels need a Hopper GPU (H100/H200)")
    generator = torch.Generator().manual_seed(page_size)
    layout = CacheLayout(patches_per_frame=page_size, specials_per_frame=6, scale_frames=scale, window_frames=window)
    limit = PagedTwoStreamCache.pages_needed(layout, 30)
    cache = PagedTwoStreamCache(layout, PagePool(limit, max_pages=limit))
    kv = PagedKV(2, 4, 64, page_size, torch.bfloat16, "cuda", limit)
    fast, reference = flashinfer_backend(kv, layout.tokens_per_frame, variant), SDPAPagedAttention(kv)
    worst = worst_sdpa = 0.0
    for step in range(24):
        defer = step > 3 and bool(torch.rand(1, generator=generator) < 0.5)
        for _ in range(scale if step == 0 else 1):  # the scale step: several frames, the other wrapper
            cache.append(defer_eviction=defer)
        slots = torch.tensor([s for i in range(-cache.num_pending_frames, 0) for s in cache.token_slots(i)],
                             device="cuda")
        for layer in range(2):
            k, v = (torch.randn(len(slots), 4, 64, generator=generator).cuda() for _ in range(2))
            kv.write(layer, slots, k, v)
        visible = cache.visible_pages()
        q = torch.randn(len(slots), 4, 64, generator=generator).cuda().bfloat16()
        fast.plan(visible, len(slots))
        reference.plan(visible, len(slots))
        for layer in range(2):
            # float32 attention over the same (bf16) pages, gathered by the SDPA reference's code
            keys, values = kv.gather(layer, kv.visible_rows(visible))
            expected = torch.nn.functional.scaled_dot_product_attention(
                q.float().transpose(0, 1)[None], keys.float().transpose(0, 1)[None], values.float().transpose(0, 1)[None]
            )[0].transpose(0, 1)
            worst = max(worst, (fast.attend(layer, q).float() - expected).abs().max().item())
            worst_sdpa = max(worst_sdpa, (reference.attend(layer, q).float() - expected).abs().max().item())
        cache.rollback() if defer and bool(torch.rand(1, generator=generator) < 0.5) else cache.commit()
    assert worst < 2e-2, f"max |flashinfer - fp32 attention| = {worst}"
    assert worst_sdpa < 2e-2, f"max |sdpa bf16 - fp32 attention| = {worst_sdpa}"


@pytest.mark.parametrize("tokens", [857, 1042, 1375])
def test_flashinfer_at_the_streaming_shape_matches_sdpa(flashinfer_backend, tokens):
    """A full window (8 scale + 64 window frames of pages, every frame's specials), a frame's queries through
    the CUDA-graph wrapper, recorded and replayed, against SDPA in float32 over the same bf16 pages."""
    from stream_recon.cache import backends

    torch.manual_seed(tokens)
    layout = CacheLayout(patches_per_frame=tokens - 6, specials_per_frame=6, scale_frames=8, window_frames=64)
    caches = [backends.build(backends.spec(name), layout, num_layers=1, num_heads=16, head_dim=64, max_frames=321,
                             dtype=torch.bfloat16, device="cuda") for name in ("flashinfer", "sdpa")]
    for _ in range(80):  # past a full window: pages recycled
        for cache in caches:
            cache.append()
        slots = caches[1].pending_slots()
        k, v = (torch.randn(len(slots), 16, 64, device="cuda").bfloat16() for _ in range(2))
        for cache in caches:
            cache.write(0, slots, k, v)
            cache.commit()
    q = torch.randn(tokens, 16, 64, device="cuda").bfloat16()
    for cache in caches:
        cache.append(defer_eviction=True)
        cache.plan(tokens)
    fast, reference = caches
    fast.attend(0, q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fast.attend(0, q)
    graph.replay()
    keys, values = reference.storage.gather(0, reference.storage.visible_rows(reference.bookkeeping.visible_pages()))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], keys.float().transpose(0, 1)[None], values.float().transpose(0, 1)[None])
    error = ((out.float().transpose(0, 1)[None] - expected).norm() / expected.norm()).item()
    print(f"{fast.backend_name} {tokens} tokens over {len(keys)} keys: {error:.2e} (relative)")
    assert error <= 1e-2


def test_fp32_cuda_path_matches_golden(gpu_model):
    torch.backends.cuda.matmul.allow_tf32 = False
    predictions, engine = stream(gpu_model, torch.float32, "sdpa", keyframes="all")
    assert engine.stats()["attention"] == "sdpa"
    measured = errors(predictions, np.load(GOLDEN / "all_keyframes" / "outputs.npz"))
    print("fp32 cuda sdpa vs golden", measured)
    assert max(measured.values()) <= TOLERANCE


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_bf16_backends_agree_with_golden_and_each_other(flashinfer_backend, gpu_model, scenario):
    golden = np.load(GOLDEN / scenario / "outputs.npz")
    fast, engine = stream(gpu_model, torch.bfloat16, "flashinfer", **SCENARIOS[scenario])
    assert engine.stats()["attention"].startswith("flashinfer-") and engine.stats()["cuda_graphs"]
    sdpa, _ = stream(gpu_model, torch.bfloat16, "sdpa", **SCENARIOS[scenario])
    fast_errors, sdpa_errors = errors(fast, golden), errors(sdpa, golden)
    between = errors(fast, as_golden(sdpa))
    print(f"{scenario}: flashinfer vs golden {fast_errors}; sdpa-bf16 vs golden {sdpa_errors}; flashinfer vs sdpa {between}")
    assert [p.frame_type for p in fast] == [p.frame_type for p in sdpa]
    if scenario != "flow":
        assert [p.frame_type for p in fast] == golden["frame_type"].tolist()
    for key, limit in BF16_TOLERANCE.items():
        assert fast_errors[key] <= limit, f"{key}: {fast_errors[key]:.3f} sigma"
        assert between[key] <= limit, f"{key}: {between[key]:.3f} sigma"


def test_page_accounting_over_2000_frames(flashinfer_backend):
    from stream_recon.models import StreamConfig, StreamingEngine

    engine = StreamingEngine(long_stream_tiny_model(), StreamConfig(scale_frames=8, window=64, attention="flashinfer"))
    image = torch.rand(3, 126, 224, device="cuda")
    memory = {}
    for i in range(2000):
        engine.push(image)
        if i + 1 in (500, 2000):
            memory[i + 1] = torch.cuda.memory_allocated()
    engine.finish()
    stats = engine.stats()
    page = 9 * 16
    assert stats["cached_frames"] == 2000 and stats["patch_pages_in_use"] == 72 and stats["cuda_graphs"]
    assert stats["special_pages_in_use"] == -(-2000 * 6 // page)
    assert memory[2000] - memory[500] <= 8 * 1024 * 1024  # the pool is allocated whole, up front
