"""The backend table: the folder of backends is the table, names, what `auto` picks, why a backend cannot run,
retired names, and building a cache."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from stream_recon.cache import (
    CacheCapacityError,
    CacheLayout,
    KVCache,
    PagedTwoStreamCache,
    backend_names,
    backends,
    fp8,
)

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def gpu_like(monkeypatch):
    """A CUDA device of a chosen capability, with chosen packages importable (no GPU here)."""

    def configure(capability: int | tuple[int, int], packages: tuple[str, ...]):
        major_minor = capability if isinstance(capability, tuple) else (capability, 0)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: major_minor)
        monkeypatch.setattr(backends, "importable", lambda package: package in packages)

    return configure


def test_the_folder_of_backends_is_the_table():
    """Adding a backend is one file in cache/backends/: its name is the file's, and its row is the table's."""
    files = sorted(path.stem for path in backend_names.FOLDER.glob("*.py") if path.stem != "__init__")
    assert backend_names.names() == ("auto", *(stem.replace("_", "-") for stem in files))
    assert [row.name for row in backends.BACKENDS] == list(backend_names.names()[1:])
    for row in backends.BACKENDS:
        assert row.summary and sys.modules[f"stream_recon.cache.backends.{row.module}"].ROW is row
    assert set(backends.AUTO_ORDER) == {row.name for row in backends.BACKENDS if row.auto_rank is not None}


def test_the_names_are_read_without_torch():
    code = ("import sys; from stream_recon.cache import backend_names; print(backend_names.names()); "
            "assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "'auto', 'flashinfer', 'sdpa', 'triton'" in done.stdout


def test_a_retired_name_is_told_the_one_that_replaced_it():
    assert backend_names.unknown_name_advice("dense-triton") == (
        "--attention dense-triton was retired when the cache kept one (paged) layout: use triton, or auto (the "
        "fastest that runs here)")
    assert backend_names.unknown_name_advice("flashinfer-fa3").endswith("use flashinfer, or auto (the fastest "
                                                                        "that runs here)")
    assert backend_names.unknown_name_advice("cudnn") == ("--attention must be one of auto, flashinfer, sdpa, triton, "
                                                          "got 'cudnn'")


def test_auto_is_the_parity_path_on_the_cpu_or_in_float32():
    assert backends.resolve("auto", CPU, torch.float32).name == "sdpa"
    assert backends.resolve("auto", CPU, torch.bfloat16).name == "sdpa"
    assert backends.resolve("auto", CUDA, torch.float32).name == "sdpa"


@pytest.mark.parametrize(("capability", "packages", "expected", "passed_over"), [
    (9, ("triton", "flashinfer"), "triton", None),
    (9, ("flashinfer",), "flashinfer", "needs the triton package"),  # Hopper without triton
    (8, ("triton", "flashinfer"), "triton", None),  # Ampere/Ada: the range kernel on pointer loads
    (7, ("triton", "flashinfer"), "flashinfer", "compute capability 8.0"),  # Triton's bf16 products need Ampere
    (8, (), "sdpa", "needs the triton package"),
])
def test_auto_on_cuda_takes_the_first_available_in_order_and_says_why_not_the_first(gpu_like, capability, packages,
                                                                                     expected, passed_over):
    gpu_like(capability, packages)
    assert backends.resolve("auto", CUDA, torch.bfloat16).name == expected
    reason = backends.auto_passed_over(CUDA, torch.bfloat16)
    assert reason is None if passed_over is None else passed_over in reason


# Triton's e4m3 type exists from Ada (8.9) on: the range kernel reads fp8 codes with it
@pytest.mark.parametrize(("capability", "expected"), [((9, 0), "triton"), ((8, 9), "triton"), ((8, 6), "sdpa")])
def test_over_an_fp8_cache_auto_takes_the_range_kernel_where_triton_has_e4m3(gpu_like, capability, expected):
    gpu_like(capability, ("triton", "flashinfer"))
    assert backends.resolve("auto", CUDA, torch.bfloat16, fp8.E4M3).name == expected
    assert backends.resolve("auto", CUDA, torch.bfloat16).name == "triton"  # bf16 pages: from 8.0 on
    if expected != "triton":
        with pytest.raises(ValueError, match=r"reads an fp8 K/V cache on a GPU of compute capability 8\.9 or newer; "
                                             r"use --attention auto or sdpa"):
            backends.resolve("triton", CUDA, torch.bfloat16, fp8.E4M3)
    with pytest.raises(ValueError, match="--attention flashinfer cannot read an fp8 K/V cache"):
        backends.resolve("flashinfer", CUDA, torch.bfloat16, fp8.E4M3)


@pytest.mark.parametrize(("capability", "quantized", "writer"), [
    ((8, 0), False, "write"), ((8, 0), True, None), ((8, 6), True, None), ((8, 9), True, "write_quantized"),
    ((9, 0), True, "write_quantized"),
])
def test_the_pages_triton_write_runs_where_triton_has_its_codes(gpu_like, monkeypatch, capability, quantized, writer):
    pytest.importorskip("triton", reason="triton is not installed")
    from stream_recon.cache import store, triton_store

    gpu_like(capability, ("triton",))
    monkeypatch.setattr(store, "importable", lambda package: package == "triton")
    kernel = store.store_write_kernel(CUDA, quantized, head_dim=64)
    assert kernel is (None if writer is None else getattr(triton_store, writer))
    assert store.store_write_kernel(CUDA, False, head_dim=48) is None  # not a power of two
    assert store.store_write_kernel(CPU, False, head_dim=64) is None


def test_an_explicit_backend_that_cannot_run_says_why_and_what_instead(gpu_like):
    with pytest.raises(ValueError, match="unknown attention backend 'dense-triton'"):
        backends.resolve("dense-triton", CUDA, torch.bfloat16)
    with pytest.raises(ValueError, match=r"needs bf16/fp16 on a CUDA device \(got float32 on cpu\); use --attention "
                                         r"auto or sdpa"):
        backends.resolve("triton", CPU, torch.float32)
    gpu_like(8, ())
    with pytest.raises(ValueError, match=r"needs the flashinfer package \(on a CUDA machine .*\); use --attention "
                                         r"auto or sdpa"):
        backends.resolve("flashinfer", CUDA, torch.bfloat16)
    with pytest.raises(ValueError, match="compute capability 8.0"):
        gpu_like(7, ("triton",))
        backends.resolve("triton", CUDA, torch.bfloat16)


def test_importable_is_asked_once_per_package():
    backends.importable.cache_clear()
    assert backends.importable("json") and not backends.importable("no_such_package_here")
    assert backends.importable.cache_info().currsize == 2


def _built(stored: torch.dtype | None = None) -> tuple[KVCache, CacheLayout]:
    layout = CacheLayout(patches_per_frame=4, specials_per_frame=2, scale_frames=2, window_frames=3)
    cache = backends.build(backends.spec("sdpa"), layout, num_layers=2, num_heads=2, head_dim=8, max_frames=16,
                           dtype=torch.float32, device=CPU, stored=stored)
    return cache, layout


def test_build_gives_a_cache_over_pages_served_by_the_row():
    cache, layout = _built()
    assert isinstance(cache, KVCache) and cache.backend_name == "sdpa"
    assert not cache.records_steps  # a CPU pool grows: its storage moves
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


def test_fp8_build_gives_quantized_pages_of_the_bytes_the_table_counts():
    layout = CacheLayout(patches_per_frame=4, specials_per_frame=2, scale_frames=2, window_frames=3)
    arguments = dict(num_layers=2, num_heads=2, head_dim=8, max_frames=16, dtype=torch.float32)
    cache = backends.build(backends.spec("sdpa"), layout, stored=fp8.E4M3, device=CPU, **arguments)
    assert cache.store_dtype == fp8.E4M3 and cache.dtype == torch.float32
    while cache.storage.num_pages < cache.bookkeeping.pool.max_pages:  # the pool grown to its limit
        cache.append()
        cache.commit()
    # (a CPU pool's growth holds one layer twice: the table counts that layer too)
    per_layer = cache.bytes_allocated // 2
    assert backends.cache_bytes(layout, stored=fp8.E4M3, device_type="cpu", **arguments) == 3 * per_layer
    assert backends.cache_bytes(layout, stored=fp8.E4M3, device_type="cuda", **arguments) == 2 * per_layer


def test_clear_forgets_every_frame_and_zeroes_the_storage():
    cache, layout = _built()
    for _ in range(2):
        cache.append()
    cache.plan(2 * layout.tokens_per_frame)
    slots = cache.pending_slots()
    nan = torch.full((len(slots), 2, 8), float("nan"))
    for layer in range(2):
        cache.write(layer, slots, nan, nan)
    cache.commit()
    assert all(tensor.isnan().any() for tensor in cache.storage.layers)
    cache.clear()
    assert cache.num_committed_frames == 0 and cache.num_visible_tokens == 0
    assert all((tensor == 0).all() for tensor in cache.storage.layers)


def test_a_cache_beside_another_holds_its_pages_in_that_ones_storage_and_is_taken_over_inside_it():
    """A storage lending the block past its pool: the cache built beside it indexes that block (its pool's ids
    start past the lender's), zeroes only it, counts no bytes of its own, and the lender takes its frames over
    by copies inside the one storage; a block too small for the layout is refused."""
    layout = CacheLayout(patches_per_frame=4, specials_per_frame=2, scale_frames=2, window_frames=3)
    spare_layout = CacheLayout(patches_per_frame=4, specials_per_frame=2, scale_frames=2, window_frames=3,
                               window_slots=1)
    arguments = dict(num_layers=2, num_heads=2, head_dim=8, max_frames=16, dtype=torch.float32, device=CPU)
    spare_pages = PagedTwoStreamCache.pages_needed(spare_layout, 16)
    lender = backends.build(backends.spec("sdpa"), layout, pages_beside=spare_pages, **arguments)
    pool = lender.bookkeeping.pool
    assert pool.whole and lender.storage.num_pages == pool.num_pages + spare_pages == lender.pages_beside + pool.end_id
    spare = backends.build(backends.spec("sdpa"), spare_layout, beside=lender, **arguments)
    assert spare.storage is lender.storage and spare.bookkeeping.pool.first_id == pool.end_id
    assert (spare.pages_beside, spare.bytes_allocated) == (0, 0)
    generator = torch.Generator().manual_seed(0)
    for cache in (lender, spare):  # each a different stream of 3 frames
        for _ in range(3):
            cache.append()
            slots = cache.pending_slots()
            for layer in range(2):
                cache.write(layer, slots, *torch.randn(2, len(slots), 2, 8, generator=generator))
            cache.commit()
    rows = spare.storage.visible_rows(spare.bookkeeping.visible_pages())
    assert rows.min() >= pool.end_id * layout.page_size  # in the block past the lender's pages
    theirs = [spare.storage.gather(layer, rows) for layer in range(2)]
    lender.take_over(spare)
    mine = lender.storage.visible_rows(lender.bookkeeping.visible_pages())
    assert mine.max() < pool.end_id * layout.page_size
    for layer in range(2):
        for ours, expected in zip(lender.storage.gather(layer, mine), theirs[layer], strict=True):
            assert torch.equal(ours, expected)
    spare.clear()
    block = slice(pool.end_id * layout.page_size, None)
    assert all((tensor[:, block] == 0).all() and tensor[:, mine].abs().sum() > 0 for tensor in lender.storage.layers)
    with pytest.raises(CacheCapacityError, match="holds 2 past"):
        small = backends.build(backends.spec("sdpa"), layout, pages_beside=2, **arguments)
        backends.build(backends.spec("sdpa"), spare_layout, beside=small, **arguments)
