"""The backend table: names, what `auto` picks, why a backend cannot run, and building each layout."""

from __future__ import annotations

import pytest
import torch

from stream_recon.cache import DenseKVCache, PagedKVCache, backends, fp8
from stream_recon.cache.layout import CacheLayout

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def gpu_like(monkeypatch):
    """A CUDA device of a chosen capability, with chosen packages importable (no GPU here)."""

    def configure(capability: int | tuple[int, int], packages: tuple[str, ...]):
        major_minor = capability if isinstance(capability, tuple) else (capability, 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: major_minor)
        monkeypatch.setattr(backends, "importable", lambda package: package in packages)

    return configure


def test_every_name_is_one_row_and_auto_comes_first():
    names = backends.names()
    assert names[0] == "auto" and len(set(names)) == len(names)
    assert {backends.spec(name).layout for name in names[1:]} == {"paged", "dense"}
    assert all(backends.spec(name).summary for name in names[1:])


def test_auto_is_the_parity_path_on_the_cpu_or_in_float32():
    assert backends.resolve("auto", CPU, torch.float32).name == "sdpa"
    assert backends.resolve("auto", CPU, torch.bfloat16).name == "sdpa"
    assert backends.resolve("auto", CUDA, torch.float32).name == "sdpa"


@pytest.mark.parametrize(("capability", "packages", "expected"), [
    (9, ("triton", "flashinfer"), "dense-triton"),
    (9, ("flashinfer",), "dense-cudnn"),  # Hopper without triton
    (8, ("triton", "flashinfer"), "dense-triton"),  # Ampere/Ada: the range kernel on pointer loads
    (8, ("flashinfer",), "dense-flashinfer"),  # without triton; cuDNN is not preferred before Hopper
    (7, ("triton", "flashinfer"), "dense-flashinfer"),  # Triton's bf16 products need Ampere
    (8, (), "dense"),
])
def test_auto_on_cuda_takes_the_first_available_in_order(gpu_like, capability, packages, expected):
    gpu_like(capability, packages)
    assert backends.resolve("auto", CUDA, torch.bfloat16).name == expected


# Triton's e4m3 type exists from Ada (8.9) on: dense-triton reads fp8 codes with it
@pytest.mark.parametrize(("capability", "expected"), [
    ((9, 0), "dense-triton"), ((8, 9), "dense-triton"), ((8, 6), "dense-flashinfer"), ((8, 0), "dense-flashinfer"),
])
def test_over_an_fp8_cache_auto_takes_dense_triton_where_triton_has_e4m3(gpu_like, capability, expected):
    gpu_like(capability, ("triton", "flashinfer"))
    assert backends.resolve("auto", CUDA, torch.bfloat16, fp8.E4M3).name == expected
    assert backends.resolve("auto", CUDA, torch.bfloat16).name == "dense-triton"  # bf16 stores: from 8.0 on
    if expected != "dense-triton":
        with pytest.raises(ValueError, match=r"reads an fp8 K/V cache on a GPU of compute capability 8\.9 or newer; "
                                             r"use --attention auto or dense"):
            backends.resolve("dense-triton", CUDA, torch.bfloat16, fp8.E4M3)


@pytest.mark.parametrize(("capability", "quantized", "writer"), [
    ((8, 0), False, "write"), ((8, 0), True, None), ((8, 6), True, None), ((8, 9), True, "write_quantized"),
    ((9, 0), True, "write_quantized"),
])
def test_the_stores_triton_write_runs_where_triton_has_its_codes(gpu_like, monkeypatch, capability, quantized,
                                                                writer):
    pytest.importorskip("triton", reason="triton is not installed")
    from stream_recon.cache import dense_attention, triton_store

    gpu_like(capability, ("triton",))
    monkeypatch.setattr(dense_attention, "importable", lambda package: package == "triton")
    kernel = dense_attention.store_write_kernel(CUDA, quantized, head_dim=64)
    assert kernel is (None if writer is None else getattr(triton_store, writer))
    assert dense_attention.store_write_kernel(CUDA, False, head_dim=48) is None  # not a power of two
    assert dense_attention.store_write_kernel(torch.device("cpu"), False, head_dim=64) is None


def test_an_explicit_backend_that_cannot_run_says_why_and_what_instead(gpu_like):
    with pytest.raises(ValueError, match="unknown attention backend 'triton'"):
        backends.resolve("triton", CUDA, torch.bfloat16)
    with pytest.raises(ValueError, match=r"needs bf16/fp16 on a CUDA device \(got float32 on cpu\); use --attention "
                                         r"auto or dense"):
        backends.resolve("dense-triton", CPU, torch.float32)
    gpu_like(8, ())
    with pytest.raises(ValueError, match=r"needs the flashinfer package \(on a CUDA machine: .*\); use --attention auto or sdpa"):
        backends.resolve("flashinfer", CUDA, torch.bfloat16)
    with pytest.raises(ValueError, match="compute capability 8.0"):
        gpu_like(7, ("triton",))
        backends.resolve("dense-triton", CUDA, torch.bfloat16)
    assert backends.resolve("dense-cudnn", CUDA, torch.float16).name == "dense-cudnn"  # explicit names stay


def test_importable_is_asked_once_per_package():
    backends.importable.cache_clear()
    assert backends.importable("json") and not backends.importable("no_such_package_here")
    assert backends.importable.cache_info().currsize == 2


@pytest.mark.parametrize(("name", "kind"), [("sdpa", PagedKVCache), ("dense", DenseKVCache)])
def test_build_gives_the_layout_of_the_row(name, kind):
    layout = CacheLayout(patches_per_frame=4, specials_per_frame=2, scale_frames=2, window_frames=3)
    cache = backends.build(backends.spec(name), layout, num_layers=2, num_heads=2, head_dim=8, max_frames=16,
                           dtype=torch.float32, device=CPU)
    assert isinstance(cache, kind) and cache.layout_name == backends.spec(name).layout
    assert cache.backend_name == name and cache.records_steps == (kind is DenseKVCache)
    for _ in range(2):
        cache.append()
    cache.plan(2 * layout.tokens_per_frame)
    slots = cache.pending_slots()
    assert slots.shape == (2 * layout.tokens_per_frame,) and len(set(slots.tolist())) == len(slots)
    q = torch.randn(len(slots), 2, 8)
    out = cache.step(slots)(0, q, torch.randn_like(q), torch.randn_like(q))
    assert out.shape == q.shape and torch.isfinite(out).all()
    cache.commit()
    assert cache.num_committed_frames == 2 and cache.num_visible_tokens == 2 * layout.tokens_per_frame


@pytest.mark.parametrize("name", ["sdpa", "dense"])
def test_clear_forgets_every_frame_and_zeroes_the_storage(name):
    layout = CacheLayout(patches_per_frame=4, specials_per_frame=2, scale_frames=2, window_frames=3)
    cache = backends.build(backends.spec(name), layout, num_layers=2, num_heads=2, head_dim=8, max_frames=16,
                           dtype=torch.float32, device=CPU)
    for _ in range(2):
        cache.append()
    cache.plan(2 * layout.tokens_per_frame)
    slots = cache.pending_slots()
    nan = torch.full((len(slots), 2, 8), float("nan"))
    for layer in range(2):
        cache.write(layer, slots, nan, nan)
    cache.commit()
    storage = cache.storage.kv_pages if name == "sdpa" else [cache.storage.store]
    assert all(tensor.isnan().any() for tensor in storage)
    cache.clear()
    assert cache.num_committed_frames == 0 and cache.num_visible_tokens == 0
    assert all((tensor == 0).all() for tensor in storage)
