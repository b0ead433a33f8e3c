"""The memory budget (models/stream/memory.py) and the fp8 K/V cache through the engine, on the tiny model
(CPU): which settings a budget gets, that every plan fits and more budget never gets a worse one,
that the estimate's exact parts are what the engine allocates, and that streaming over an fp8
cache is streaming over the dequantised keys. `pytest -k "fp8 or budget"` selects them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from engine_helpers import assert_streams_like_the_visible_set_model, frames
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_recon.cache import PagedTwoStreamCache, TokenCache, fp8
from stream_recon.models import (
    ChunkedEngine,
    MemoryBudgetError,
    StreamConfig,
    StreamingEngine,
    estimate_memory,
    plan_memory,
)
from stream_recon.models.stream.memory import MIN_WINDOW

SIZE = (42, 56)  # a 3 x 4 patch grid

def total(model, config: StreamConfig, **changes) -> int:
    return estimate_memory(model, dataclasses.replace(config, **changes), SIZE).total


def test_the_cuda_context_counts_in_the_budget_and_is_not_a_spares_or_the_allocators(prepared_tiny_model):
    """A budget is the whole process's: on CUDA the estimate counts a context beside the tensors, which
    a spare engine shares and torch's peak counters do not see. A CPU run has none."""
    from stream_recon.models.stream.memory import CUDA_CONTEXT_BYTES

    config = StreamConfig(scale_frames=3, window=40, attention="sdpa")
    on_cpu = estimate_memory(prepared_tiny_model, config, SIZE)
    assert on_cpu.cuda_context == 0 and on_cpu.tensors == on_cpu.total
    on_cuda = dataclasses.replace(on_cpu, cuda_context=CUDA_CONTEXT_BYTES)
    assert on_cuda.total == on_cpu.total + CUDA_CONTEXT_BYTES and on_cuda.tensors == on_cpu.total
    assert on_cuda.another_engine == on_cpu.another_engine
    assert on_cuda.to_dict()["cuda_context"] == CUDA_CONTEXT_BYTES and "cuda context 1.00 GiB" in on_cuda.describe()


def test_a_process_held_to_a_card_gets_the_budget_less_the_context(monkeypatch):
    """hold_to_card: the allocator's share of the device is what a card of the budget leaves beside the CUDA
    context, on the device named (else the current one), and never above the whole device."""
    import types

    from stream_recon.models.stream.memory import CUDA_CONTEXT_BYTES, hold_to_card

    set_fractions = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: types.SimpleNamespace(total_memory=80 * 2**30))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index: set_fractions.append((fraction, index)))
    hold_to_card(16 * 2**30, "cuda:1")
    hold_to_card(8 * 2**30)
    hold_to_card(100 * 2**30, "cuda")
    hold_to_card(CUDA_CONTEXT_BYTES // 2, "cuda:0")
    assert set_fractions == [((16 * 2**30 - CUDA_CONTEXT_BYTES) / (80 * 2**30), 1),
                             ((8 * 2**30 - CUDA_CONTEXT_BYTES) / (80 * 2**30), 3), (1.0, 3), (0.0, 0)]


# -- which choice for which budget -------------------------------------------------------------------
def test_budget_that_holds_the_asked_settings_changes_nothing(prepared_tiny_model):
    config = StreamConfig(scale_frames=3, window=40, attention="sdpa")
    plan = plan_memory(prepared_tiny_model, config, SIZE, total(prepared_tiny_model, config))
    assert (plan.kv_cache, plan.window, plan.reasons, plan.changes_results) == ("fp32", 40, (), False)
    assert plan.apply(config) == dataclasses.replace(config, kv_cache="fp32")


def test_budget_below_the_asked_precision_gets_the_fp8_cache(prepared_tiny_model):
    config = StreamConfig(scale_frames=3, window=40, attention="sdpa")
    needed_fp32, needed_fp8 = total(prepared_tiny_model, config), total(prepared_tiny_model, config, kv_cache="fp8")
    assert needed_fp8 < needed_fp32
    plan = plan_memory(prepared_tiny_model, config, SIZE, needed_fp32 - 1)
    assert (plan.kv_cache, plan.window, plan.changes_results) == ("fp8", 40, False)
    assert plan.estimate.total == needed_fp8 <= plan.budget
    assert plan.reasons == (f"The fp32 cache would need {needed_fp32 / 2**20:.1f} MiB.",)
    assert plan.describe().startswith(f"memory plan for {(needed_fp32 - 1) / 2**20:.1f} MiB: fp8 K/V cache, window 40;")
    assert plan.apply(config).kv_cache == "fp8"


def test_budget_below_the_fp8_cache_shortens_the_window_and_says_results_change(prepared_tiny_model):
    config = StreamConfig(scale_frames=3, window=40, attention="sdpa")
    budget = total(prepared_tiny_model, config, kv_cache="fp8", window=25)
    plan = plan_memory(prepared_tiny_model, config, SIZE, budget + 1)
    assert (plan.kv_cache, plan.window, plan.changes_results) == ("fp8", 25, True)
    [reason] = plan.reasons
    assert reason.startswith("Warning: the window was shortened from 40 to 25 frames to fit") and "results change" in reason
    assert plan.to_dict()["asked"] == {"kv_cache": "fp32", "window": 40} and plan.to_dict()["changes_results"]


def test_budget_nothing_fits_names_the_smallest_budget(prepared_tiny_model):
    config = StreamConfig(scale_frames=3, window=40, attention="sdpa")
    smallest = total(prepared_tiny_model, config, kv_cache="fp8", window=MIN_WINDOW)
    with pytest.raises(MemoryBudgetError, match=rf"cannot hold this run at 56x42: the smallest setting allowed \(fp8 "
                                                rf"K/V cache, window {MIN_WINDOW}\) needs .*; give it at least "
                                                rf"{smallest / 2**20:.1f} MiB"):
        plan_memory(prepared_tiny_model, config, SIZE, smallest - 1)
    assert plan_memory(prepared_tiny_model, config, SIZE, smallest).window == MIN_WINDOW


def test_budget_keeps_an_explicit_precision(prepared_tiny_model):
    config = StreamConfig(scale_frames=3, window=40, attention="sdpa", kv_cache="fp32")
    plan = plan_memory(prepared_tiny_model, config, SIZE, total(prepared_tiny_model, config) - 1)
    assert plan.kv_cache == "fp32" and plan.window == 39


def test_budget_must_be_positive(prepared_tiny_model):
    with pytest.raises(MemoryBudgetError, match="must be positive"):
        plan_memory(prepared_tiny_model, StreamConfig(), SIZE, 0)
    with pytest.raises(MemoryBudgetError, match="positive number of bytes"):
        StreamingEngine(prepared_tiny_model, StreamConfig(gpu_memory=-1))


CONFIGS = st.builds(StreamConfig, scale_frames=st.integers(1, 4), window=st.integers(1, 48),
                    kv_cache=st.sampled_from(["auto", "fp8", "fp32"]), attention=st.sampled_from(["auto", "sdpa"]))


def preference(plan) -> tuple[int, bool]:
    """Larger is better: the window first, then the precision asked for."""
    return plan.window, plan.kv_cache == plan.asked_kv_cache


@settings(max_examples=150, deadline=None)
@given(config=CONFIGS, fractions=st.lists(st.floats(0.5, 1.2), min_size=2, max_size=2))
@pytest.mark.slow
def test_budget_plans_fit_and_more_budget_never_plans_worse(prepared_tiny_model, config, fractions):
    asked = total(prepared_tiny_model, config)
    smallest = total(prepared_tiny_model, config, kv_cache="fp8" if config.kv_cache != "fp32" else config.kv_cache,
                     window=min(config.window, MIN_WINDOW))
    plans = []
    for budget in sorted(int(asked * f) for f in fractions):
        if budget < smallest:
            with pytest.raises(MemoryBudgetError):
                plan_memory(prepared_tiny_model, config, SIZE, budget)
            plans.append(None)
            continue
        plan = plan_memory(prepared_tiny_model, config, SIZE, budget)
        assert plan.estimate.total <= budget
        assert plan.estimate == estimate_memory(prepared_tiny_model, plan.apply(config), SIZE)
        assert plan.window <= config.window and (plan.window == config.window or plan.window >= MIN_WINDOW)
        assert (budget >= asked) == (preference(plan) == (config.window, True))
        plans.append(plan)
    smaller, larger = plans
    if smaller is not None:
        assert larger is not None and preference(larger) >= preference(smaller)


# -- the estimate against what the engine allocates ----------------------------------------------------
@pytest.mark.parametrize(("attention", "kv_cache"), [("sdpa", "fp8"), ("sdpa", "auto")])
@pytest.mark.slow
def test_budget_estimate_counts_the_cache_the_engine_allocates(prepared_tiny_model, attention, kv_cache):
    config = StreamConfig(scale_frames=2, window=3, attention=attention, kv_cache=kv_cache, max_cached_frames=40)
    estimate = estimate_memory(prepared_tiny_model, config, SIZE)
    engine = StreamingEngine(prepared_tiny_model, config)
    for image in frames(39):  # the paged pool grows to its limit: every frame the cache can hold
        engine.push(image)
    allocated = engine.cache.bytes_allocated
    # pages up to the limit, plus one layer's copy while the CPU's pool grows (the tiny model's 4 global layers)
    assert allocated * (1 + 1 / 4) == estimate.kv_cache
    c = prepared_tiny_model.config
    assert estimate.camera_cache == TokenCache.bytes_needed(prepared_tiny_model.camera_head.num_cache_layers, c.camera_heads,
                                                            c.head_in_dim // c.camera_heads, 40, torch.float32)
    assert estimate.weights == sum(p.numel() * p.element_size() for p in prepared_tiny_model.parameters())
    assert estimate.graph_pools == 0  # no CUDA graphs on the CPU
    rows, cols = c.grid(*SIZE)
    kept = [t for key, t in prepared_tiny_model.depth_head._uv_tables.items() if key[:2] in {(rows, cols), SIZE}]
    assert estimate.head_tables == sum(t.numel() * t.element_size() for t in kept) > 0  # the DPT head keeps them
    assert estimate.another_engine == estimate.total - estimate.weights - estimate.head_tables - estimate.workspace
    # the SDPA reference gathers its pages (dequantised, from an fp8 cache)
    assert estimate.attention_copies > 0


def test_budget_paged_pool_stops_at_its_limit_with_a_clear_error(prepared_tiny_model):
    from stream_recon.cache import CacheCapacityError

    engine = StreamingEngine(prepared_tiny_model, StreamConfig(scale_frames=2, window=3, attention="sdpa", max_cached_frames=5))
    images = frames(12)
    pushed = 0
    with pytest.raises(CacheCapacityError, match=r"needs \d+ more pages but is at its limit of \d+; start a fresh cache"):
        for image in images:
            engine.push(image)
            pushed += 1
    pool = engine.cache.bookkeeping.pool
    limit = PagedTwoStreamCache.pages_needed(engine.cache.layout, 5)
    assert pool.num_pages == limit == pool.max_pages and pushed >= 5  # grown to the limit, and no further
    assert engine.cache.num_committed_frames == pushed and engine.cache.num_pending_frames == 0  # the refused frame left nothing
    assert engine.cache.bytes_allocated <= estimate_memory(
        prepared_tiny_model, StreamConfig(scale_frames=2, window=3, attention="sdpa", max_cached_frames=5), SIZE).kv_cache


def test_budget_engine_plans_before_the_first_frame_and_streams_the_plan(prepared_tiny_model):
    asked = StreamConfig(scale_frames=2, window=3, attention="auto")  # auto: sdpa on the CPU, over fp8 too
    budget = total(prepared_tiny_model, asked) - 1
    engine = StreamingEngine(prepared_tiny_model, dataclasses.replace(asked, gpu_memory=budget))
    told = []
    engine.on_memory_plan = told.append
    assert engine.memory_plan is None
    predictions = [p for image in frames(6) for p in engine.push(image)] + engine.finish()
    assert len(predictions) == 6 and len(told) == 1 and told[0] is engine.memory_plan
    assert engine.memory_plan.kv_cache == "fp8" and engine.stats()["kv_cache"] == "fp8"
    # (a CPU pool grows as frames come: 6 frames hold fewer pages than the plan's limit)
    assert engine.stats()["attention"] == "sdpa" and engine.cache.bytes_allocated <= engine.memory_plan.estimate.kv_cache
    too_small = StreamingEngine(prepared_tiny_model, dataclasses.replace(asked, gpu_memory=2**20))
    with pytest.raises(MemoryBudgetError, match="cannot hold this run"):
        too_small.push(frames(1)[0])
    assert too_small.cache is None  # nothing was allocated


def test_budget_plan_made_ahead_is_the_first_frames_and_is_made_again_for_another_size(prepared_tiny_model,
                                                                                        monkeypatch):
    """plan_memory_for: the plan the first frame would make, made before it (once, not again at the
    first frame of that size); a first frame of another size is planned for then."""
    import stream_recon.models.stream.engine as engine_module

    asked = StreamConfig(scale_frames=2, window=3, attention="auto")
    config = dataclasses.replace(asked, gpu_memory=total(prepared_tiny_model, asked) - 1)  # fp8 fits
    planned = []
    plan_memory_counted = engine_module.plan_memory

    def plan_counted(model, config, image_size, budget):
        planned.append(image_size)
        return plan_memory_counted(model, config, image_size, budget)

    monkeypatch.setattr(engine_module, "plan_memory", plan_counted)
    images = frames(5)
    ahead = StreamingEngine(prepared_tiny_model, config)
    told = []
    ahead.on_memory_plan = told.append
    plan = ahead.plan_memory_for(SIZE)
    streamed = [p for image in images for p in ahead.push(image)] + ahead.finish()
    assert planned == [SIZE] and told == [plan] and ahead.memory_plan is plan and plan.kv_cache == "fp8"
    assert ahead.plan_memory_for(SIZE) is None  # planned and applied already

    at_first_frame = StreamingEngine(prepared_tiny_model, config)
    reference = [p for image in images for p in at_first_frame.push(image)] + at_first_frame.finish()
    assert planned == [SIZE, SIZE] and at_first_frame.memory_plan == plan
    assert len(streamed) == len(reference) == 5
    for ours, theirs in zip(streamed, reference, strict=True):
        for key in ("pose_enc", "c2w", "depth", "depth_conf"):
            np.testing.assert_array_equal(getattr(ours, key), getattr(theirs, key))

    other_size = StreamingEngine(prepared_tiny_model, config)
    other_size.plan_memory_for((28, 42))
    other_size.push(images[0])
    assert planned[2:] == [(28, 42), SIZE] and other_size.memory_plan == plan
    assert StreamingEngine(prepared_tiny_model, asked).plan_memory_for(SIZE) is None  # no budget


def test_budget_windowed_cache_holds_one_window_and_plans_for_it(prepared_tiny_model):
    config = StreamConfig(scale_frames=2, window=3, keyframes="interval:2", attention="sdpa", gpu_memory=2**40)
    engine = ChunkedEngine(prepared_tiny_model, config, chunk_frames=6, overlap=2)
    told = []
    engine.on_memory_plan = told.append
    predictions = [p for image in frames(30) for p in engine.push(image)] + engine.finish()
    assert engine.rollovers >= 2 and len(predictions) >= 30
    cache = engine.engine.cache
    # its pool holds the special tokens of a chunk's frames and one pending frame, and has grown to it
    assert cache.bookkeeping.pool.max_pages == cache.bookkeeping.pool.num_pages == PagedTwoStreamCache.pages_needed(
        cache.layout, 7)
    assert len(told) == 1 and engine.memory_plan is told[0]
    # (and one layer's copy while the CPU's pool grows: the tiny model's 4 global layers)
    assert engine.memory_plan.estimate.kv_cache == cache.bytes_allocated * (1 + 1 / 4)


def test_budget_max_cached_frames_is_checked(prepared_tiny_model):
    with pytest.raises(ValueError, match="max_cached_frames=2 must be more than scale_frames"):
        StreamingEngine(prepared_tiny_model, StreamConfig(scale_frames=2, max_cached_frames=2))


# -- streaming over an fp8 cache -----------------------------------------------------------------------
def test_fp8_cache_streams_as_attention_over_the_dequantised_keys(prepared_tiny_model):
    """The engine over an fp8 store equals a list-based model of the spec's key set whose K/V go
    through the e4m3 round trip: the only change fp8 makes is the stored values."""
    images = frames(10, seed=2)
    engine = StreamingEngine(prepared_tiny_model, StreamConfig(scale_frames=2, window=3, kv_cache="fp8"))
    streamed = [p for image in images for p in engine.push(image)] + engine.finish()
    assert engine.stats()["kv_cache"] == "fp8" and engine.stats()["attention"] == "sdpa"
    assert_streams_like_the_visible_set_model(prepared_tiny_model, streamed, images, scale_frames=2, window=3,
                                              transform_kv=lambda x: fp8.dequantize(*fp8.quantize(x), x.dtype))


def test_fp8_cache_stays_close_to_the_float32_cache_and_keeps_flow_decisions(prepared_tiny_model):
    images = frames(14, seed=3)
    runs = {}
    for kv_cache in ("auto", "fp8"):
        config = StreamConfig(scale_frames=3, window=4, attention="sdpa", kv_cache=kv_cache, keyframes="flow",
                              flow_threshold=1.0, max_gap=3)
        engine = StreamingEngine(prepared_tiny_model, config)
        runs[kv_cache] = [p for image in images for p in engine.push(image)] + engine.finish()
        assert engine.stats()["kv_cache"] == {"auto": "fp32", "fp8": "fp8"}[kv_cache]
    exact, quantized = runs["auto"], runs["fp8"]
    assert [p.frame_type for p in quantized] == [p.frame_type for p in exact]
    for key in ("depth", "depth_conf", "pose_enc"):
        ours, theirs = (np.stack([getattr(p, key) for p in run]) for run in (quantized, exact))
        assert 0 < np.abs(ours - theirs).max() <= 1e-2 * theirs.std(), key  # changed, but only a little


def test_an_unknown_cache_precision_is_refused(prepared_tiny_model):
    with pytest.raises(ValueError, match="unknown K/V cache precision 'int4'"):
        StreamingEngine(prepared_tiny_model, StreamConfig(kv_cache="int4"))
