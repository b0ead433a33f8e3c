"""Memory and time estimates before a CPU run (app.run.resources): the numbers against a measured peak
and a real run's cache, the refusal with smaller settings that fit, the slow-CPU warning, and the CLI."""

from __future__ import annotations

import inspect
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from media_helpers import write_video
from typer.testing import CliRunner

from stream_recon.app.cli import app, with_default_command
from stream_recon.app.run import resources
from stream_recon.app.run.resources import (
    ModelShape,
    RunShape,
    estimate_host_memory,
    model_shape,
    plan_host_memory,
    refusal_message,
    seconds_per_frame,
    slow_cpu_message,
)
from stream_recon.cache import (
    POOL_GROWTH_PAGES,
    SPECIAL_PAGES_AT_START,
    CacheLayout,
    PagedTwoStreamCache,
    PagePool,
    backends,
)
from stream_recon.models import ModelConfig, StreamConfig, StreamingEngine
from stream_recon.models.stream import memory

GB = 1e9

FULL = model_shape(ModelConfig())
SAMPLE = RunShape(source_size=(224, 126))  # the bundled sample, 16:9: 518 x 294 at the default width


def test_the_full_model_is_4_6_gb_of_float32_weights() -> None:
    assert FULL.num_params * 4 == pytest.approx(4.63e9, rel=0.01)


def test_the_cpu_cache_grows_with_the_frames_of_a_stream() -> None:
    # a 3-frame CPU run at the defaults peaked at 21 GB: the cache was allocated for the whole window
    pages = {frames: estimate_host_memory(FULL, replace(SAMPLE, frames=frames)).cache_pages for frames in (3, 12, None)}
    assert pages == {3: 8 + 1 + 2, 12: 8 + 1 + 2 + 16, None: 8 + 64 + 1 + 3}  # the last: capped at the most needed
    estimate = estimate_host_memory(FULL, replace(SAMPLE, frames=3))
    assert estimate.tokens_per_page == 37 * 21 and estimate.cache_bytes == 11 * 777 * 24 * 2 * 1024 * 4  # 1.7 GB
    assert estimate.total_bytes < 8 * GB


@pytest.mark.parametrize(("frames", "source_size", "window"),
                         [(2, (160, 96), 4), (7, (160, 96), 4), (40, (160, 96), 4), (12, (90, 160), 6), (60, (160, 96), 40)])
@pytest.mark.slow
def test_the_cache_estimate_is_the_cache_the_engine_allocates(prepared_tiny_model, frames, source_size, window) -> None:
    # on the CPU the paged cache starts with the scale frames' pages and grows as frames come
    run = RunShape(source_size=source_size, image_width=56, scale_frames=3, window=window, frames=frames)
    engine = StreamingEngine(prepared_tiny_model, StreamConfig(scale_frames=3, window=window))
    height, width = run.input_size
    for _ in range(frames):
        engine.push(torch.rand(3, height, width))
    engine.finish()
    assert estimate_host_memory(model_shape(prepared_tiny_model.config), run).cache_bytes == engine.cache.bytes_allocated


def test_the_host_estimate_counts_the_pool_the_cache_builds() -> None:
    # the pool's first pages and growth step are the cache's own, so the estimate cannot drift from it
    layout = CacheLayout(patches_per_frame=777, specials_per_frame=6, scale_frames=8, window_frames=64)
    cache = backends.build(backends.spec("sdpa"), layout, num_layers=1, num_heads=1, head_dim=1, max_frames=320,
                           dtype=torch.float32, device="cpu")
    assert cache.bookkeeping.pool.num_pages == 8 + 1 + SPECIAL_PAGES_AT_START
    assert PagedTwoStreamCache(layout).pool.num_pages == layout.max_patch_pages + SPECIAL_PAGES_AT_START
    assert cache.bookkeeping.pool.grow_by == POOL_GROWTH_PAGES
    assert inspect.signature(PagePool).parameters["grow_by"].default == POOL_GROWTH_PAGES


def test_the_host_estimate_is_the_models_memory_model() -> None:
    # one growth rule and one calibration of a CPU step, both models/stream/memory.py's: the app's estimate
    # asks them and keeps no copy of their numbers
    for frames in (3, 12, 200, None):
        run = replace(SAMPLE, frames=frames)
        estimate = estimate_host_memory(FULL, run)
        assert estimate.cache_pages == memory.cpu_cache_pages(FULL.config, 777, 8, 64, 320, frames)
        assert estimate.activation_bytes == memory.host_step_bytes(run.input_size, min(frames or 8, 8))
    source = inspect.getsource(resources)
    for copy in ("POOL_GROWTH_PAGES", "SPECIAL_PAGES_AT_START", "BYTES_PER_PIXEL", "FIXED_BYTES", "math.ceil"):
        assert copy not in source, copy


def test_the_cpu_pool_grows_as_the_cache_grows_it() -> None:
    # pages_to_hold answers what allocate does: a 3-page pool growing by 2, at most 8 pages
    pool = PagePool(3, grow_by=2, max_pages=8)
    expected = [pool.pages_to_hold(count) for count in range(1, 10)]
    held = []
    for _ in range(8):
        pool.allocate()
        held.append(pool.num_pages)
    assert expected[:8] == held == [3, 3, 3, 5, 5, 7, 7, 8] and expected[8] == 8


def test_the_model_shape_is_its_config() -> None:
    # every size comes from the ModelConfig: half the global layers, half the cache
    half = ModelShape(replace(ModelConfig(), depth=12, output_layers=(2, 5, 8, 11)), FULL.num_params)
    assert 2 * estimate_host_memory(half, SAMPLE).cache_bytes == estimate_host_memory(FULL, SAMPLE).cache_bytes
    assert FULL.config == ModelConfig() and FULL.dino_extra_tokens == 1 + ModelConfig().dino_registers


def test_a_run_that_does_not_fit_is_refused_with_smaller_settings_that_do() -> None:
    plan = plan_host_memory(FULL, SAMPLE, available_bytes=int(12 * GB))

    assert not plan.fits and plan.smaller == {"image_width": 392, "window": 32}
    assert plan.smaller_estimate.total_bytes <= 12 * GB
    assert refusal_message(plan) == (
        "these settings need about 17.39 GiB (weights 4.31 GiB, KV cache 10.81 GiB for 76 pages of 777 tokens, "
        "activations 2.27 GiB) but 11.18 GiB is available; --image-width 392 --window 32 needs about 9.51 GiB "
        "(--no-memory-check runs anyway)"
    )


def test_a_model_already_loaded_is_not_counted_again() -> None:
    # a batch worker holds the model: the memory still available is compared with what the run adds
    loaded = plan_host_memory(FULL, SAMPLE, available_bytes=int(17 * GB), count_weights=False)
    assert loaded.fits and loaded.estimate.weights_bytes == 0
    assert not plan_host_memory(FULL, SAMPLE, available_bytes=int(17 * GB)).fits
    assert "beside the weights already loaded" in loaded.estimate.describe()


def test_suggestions_never_ask_for_more_than_the_user_chose() -> None:
    small = replace(SAMPLE, image_width=308, window=8)
    plan = plan_host_memory(FULL, small, available_bytes=int(6.5 * GB))
    assert not plan.fits and plan.smaller == {"image_width": 224, "scale_frames": 4}  # the window stays at 8
    assert plan_host_memory(FULL, small, available_bytes=int(1 * GB)).smaller is None
    assert "no smaller settings fit either" in refusal_message(plan_host_memory(FULL, small, int(1 * GB)))
    assert plan_host_memory(FULL, SAMPLE, available_bytes=int(64 * GB)).fits


def test_time_per_frame_grows_as_the_window_fills() -> None:
    first, full = seconds_per_frame(FULL, SAMPLE, flops_per_second=100e9)
    assert 5 < first < full  # the full window's attention reads 72 frames instead of 9
    _, by_frame_14 = seconds_per_frame(FULL, replace(SAMPLE, frames=14), 100e9)
    assert first < by_frame_14 < full
    assert seconds_per_frame(FULL, SAMPLE, 200e9)[1] == pytest.approx(full / 2)


def test_slow_cpu_warning_says_how_slow_and_what_to_try() -> None:
    message = slow_cpu_message(FULL, SAMPLE, 100e9)
    first, full = seconds_per_frame(FULL, SAMPLE, 100e9)
    assert message.startswith(f"a CPU run is slow: about {first:.0f} s per frame at the start and {full:.0f} s "
                              "once the 64-frame window is full (this CPU multiplies float32 matrices at 100 GFLOP/s)")
    assert "; --image-width 392 --window 16 takes about" in message


def invoke(*args: str):
    return CliRunner().invoke(app, with_default_command(list(args)))


def test_cli_refuses_settings_that_cannot_fit_before_the_model_loads(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 3)
    # a .pt that does not exist: the official architecture, and loading it would fail with another error
    huge = [str(video), "--device", "cpu", "--no-viewer", "-o", str(tmp_path / "out"), "--checkpoint",
            str(tmp_path / "missing.pt"), "--image-width", "2800", "--window", "900", "--chunk-frames", "1000"]

    refused = invoke(*huge)

    assert refused.exit_code == 2, refused.output
    assert refused.output.startswith("error: these settings need about ") and "is available; " in refused.output
    assert refused.output.rstrip().endswith("(--no-memory-check runs anyway)")
    assert len(refused.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    anyway = invoke(*huge, "--no-memory-check")
    assert anyway.exit_code == 2 and "missing.pt" in anyway.output and "these settings need" not in anyway.output
