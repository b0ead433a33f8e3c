"""The warm-up's dry pass (models/builds/kernel_builds.py): which launches it takes, where their builds run, what
it waits for, and that a warm-up with one streams what a fresh engine streams.

Triton builds CUDA kernels only where a GPU is (the real builds are tests/test_gpu_fast_path.py's); here
Triton's hook is called as Triton calls it, with a kernel whose `preload` (what builds a listed
specialization) records where and what it was asked to build."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
import torch

from stream_recon.models import StreamConfig, StreamingEngine
from stream_recon.models.builds import kernel_builds
from stream_recon.models.network import step_mode
from stream_recon.models.network.step_mode import StepMode
from stream_recon.models.supervision import Helper

pytestmark = pytest.mark.skipif(not kernel_builds.available(), reason="this Triton cannot list builds")


class CompiledKernel:
    """Stands where Triton's CompiledKernel stands: `_init_handles` loads it (and makes its launcher)."""

    def __init__(self, loads: list, load_fails: bool) -> None:
        self.loads, self.load_fails = loads, load_fails

    def _init_handles(self) -> None:
        if self.load_fails:
            raise RuntimeError("out of resources: shared memory")
        self.loads.append(threading.current_thread().name)


class KernelBuiltOnPreload:
    """Stands where Triton's JITFunction stands: `preload(specialization)` builds and returns the
    compiled kernel, here it records."""

    def __init__(self, name: str, fails: bool = False, load_fails: bool = False) -> None:
        self.fn = types.SimpleNamespace(__name__=name)  # the kernel's Python source
        self.fails, self.load_fails = fails, load_fails
        self.built: list[tuple[str, str]] = []  # (specialization, the thread that built it)
        self.loads: list[str] = []  # the threads that loaded a built specialization

    def preload(self, specialization: str) -> CompiledKernel:
        if self.fails:
            raise RuntimeError(f"{self.fn.__name__} does not build")
        self.built.append((specialization, threading.current_thread().name))
        return CompiledKernel(self.loads, self.load_fails)


def launch(kernel: KernelBuiltOnPreload, key: str) -> bool | None:
    """What Triton does on a launch of a specialization not built: call the cache hook (True: skip)."""
    from triton.runtime.jit import JitFunctionInfo

    return kernel_builds._hook(key=key, repr=key, fn=JitFunctionInfo("tests", kernel.fn.__name__, kernel),
                               compile={"key": key, "specialization_data": f"data of {key}"},
                               is_manual_warmup=False, already_compiled=False)


def test_a_dry_step_skips_each_launch_and_builds_each_specialization_once_on_the_pool():
    attention, store = KernelBuiltOnPreload("attention"), KernelBuiltOnPreload("store")
    with kernel_builds.dry_launches(torch.device("cpu")) as report:
        assert step_mode.current() is StepMode.DRY
        skipped = [launch(attention, "a"), launch(store, "s"), launch(attention, "a"), launch(attention, "b")]
    assert skipped == [True] * 4 and step_mode.current() is not StepMode.DRY
    assert report.builds == 3 and report.kernels == ["attention", "store", "attention"]
    assert sorted(spec for spec, _ in attention.built) == ["data of a", "data of b"]
    assert store.built[0][0] == "data of s"
    assert all(thread.startswith("kernel-build") for _, thread in attention.built + store.built)
    # each built kernel is loaded there too, not by its first launch on the step's thread
    assert len(attention.loads) == 2 and all(thread.startswith("kernel-build") for thread in attention.loads)


def test_a_kernel_that_builds_but_does_not_load_is_left_to_its_first_launch():
    kernel = KernelBuiltOnPreload("too_big", load_fails=True)
    with kernel_builds.dry_launches(torch.device("cpu")) as report:
        launch(kernel, "k")
    assert report.builds == 1 and kernel.built and not kernel.loads  # its launch raises where it belongs


def test_launches_on_other_threads_run_and_reach_the_hook_that_was_there_before():
    kernel = KernelBuiltOnPreload("attention")
    seen = []
    kernel_builds._install()
    kernel_builds.PROCESS.hook_before[0], previous = (lambda **call: seen.append(call["key"])), kernel_builds.PROCESS.hook_before[0]
    try:
        with kernel_builds.dry_launches(torch.device("cpu")) as report:
            elsewhere = []
            worker = threading.Thread(target=lambda: elsewhere.append(launch(kernel, "other thread")))
            worker.start()
            worker.join()
        assert elsewhere == [None] and seen == ["other thread"] and report.builds == 0 and kernel.built == []
        assert launch(kernel, "after") is None and seen == ["other thread", "after"]
    finally:
        kernel_builds.PROCESS.hook_before[0] = previous


def test_a_build_that_fails_turns_the_builds_ahead_off_once_the_others_are_done(monkeypatch, caplog):
    """Its kernel builds at its first launch instead, where an error of its own belongs; the dry step goes on."""
    monkeypatch.setattr(kernel_builds.PROCESS, "ahead", Helper(kernel_builds.BUILDS_AHEAD))
    good, bad = KernelBuiltOnPreload("good"), KernelBuiltOnPreload("bad", fails=True)
    with kernel_builds.dry_launches(torch.device("cpu")) as report:
        launch(bad, "x")
        launch(good, "y")
    assert [spec for spec, _ in good.built] == ["data of y"] and step_mode.current() is not StepMode.DRY and report.builds == 2
    assert kernel_builds.PROCESS.ahead.down_reason == "building bad failed: RuntimeError: bad does not build"
    assert not kernel_builds.dry_pass_pays("cuda", compiled=False)  # no dry pass for the rest of the process
    warnings = [record for record in caplog.records if record.levelname == "WARNING"]
    assert [record.getMessage() for record in warnings] == [
        "building kernels ahead is off for the rest of the run: building bad failed: RuntimeError: bad does not build"]


def test_dry_steps_do_not_nest():
    with kernel_builds.dry_launches(torch.device("cpu")):
        with pytest.raises(RuntimeError, match="do not nest"):
            with kernel_builds.dry_launches(torch.device("cpu")):
                pass


def test_build_threads_are_the_cores_at_most_eight():
    assert 1 <= kernel_builds.build_threads() <= kernel_builds.MAX_BUILD_THREADS == 8


@pytest.mark.parametrize("keyframes", ["all", "flow"])
def test_a_warm_up_with_its_dry_pass_streams_what_a_fresh_engine_streams(prepared_tiny_model, keyframes, monkeypatch):
    """The dry pass (on the CPU no Triton kernel is launched, so nothing is skipped) runs the warm-up's
    steps once more and forgets them: the stream after it is the stream without a warm-up."""
    from engine_helpers import frames

    config = StreamConfig(scale_frames=3, window=4, keyframes=keyframes, flow_threshold=2.0)
    images = frames(9)
    warm, cold = StreamingEngine(prepared_tiny_model, config), StreamingEngine(prepared_tiny_model, config)
    seconds = warm.warm_up(images[0], dry_pass=kernel_builds.dry_pass)
    assert seconds["kernel_builds"] == 0 and seconds["kernel_builds_s"] > 0 and warm.num_frames == 0
    streams = [[p for image in images for p in engine.push(image)] + engine.finish() for engine in (warm, cold)]
    assert [p.frame_type for p in streams[0]] == [p.frame_type for p in streams[1]]
    for ours, theirs in zip(*streams, strict=True):
        np.testing.assert_array_equal(ours.depth, theirs.depth)
        np.testing.assert_array_equal(ours.pose_enc, theirs.pose_enc)


@pytest.mark.parametrize("kv_cache", ["auto", "fp8"])
def test_a_dry_pass_whose_launches_leave_garbage_leaves_none_in_the_stream(prepared_tiny_model, kv_cache,
                                                                           monkeypatch):
    """On the GPU a dry pass's skipped launches leave their outputs unwritten: whatever the memory held,
    NaN included. Emulated here: while listing, the few-token linears (the camera head's) return NaN and
    every K/V written to the cache is NaN. The stream after the warm-up is still the fresh engine's: the
    caches are zeroed after the dry pass (the camera attention weighs its spare positions by zero, and
    zero times NaN is NaN)."""
    from engine_helpers import frames

    from stream_recon.cache import store
    from stream_recon.models.network import few_token_linear

    def garbage_while_listing(function, *, outputs: bool):
        def wrapped(*args):
            if step_mode.current() is StepMode.DRY and not outputs:
                *rest, k, v = args
                return function(*rest, torch.full_like(k, float("nan")), torch.full_like(v, float("nan")))
            result = function(*args)
            return torch.full_like(result, float("nan")) if step_mode.current() is StepMode.DRY else result
        return wrapped

    monkeypatch.setattr(few_token_linear, "_few_token_linear_op",
                        garbage_while_listing(few_token_linear._few_token_linear_op, outputs=True))
    monkeypatch.setattr(store.PagedKV, "write", garbage_while_listing(store.PagedKV.write, outputs=False))
    config = StreamConfig(scale_frames=3, window=4, kv_cache=kv_cache)
    images = frames(7)
    warm, cold = StreamingEngine(prepared_tiny_model, config), StreamingEngine(prepared_tiny_model, config)
    warm.warm_up(images[0], dry_pass=kernel_builds.dry_pass)
    streams = [[p for image in images for p in engine.push(image)] + engine.finish() for engine in (warm, cold)]
    for ours, theirs in zip(*streams, strict=True):
        assert np.isfinite(ours.pose_enc).all() and np.isfinite(ours.depth).all()
        np.testing.assert_array_equal(ours.depth, theirs.depth)
        np.testing.assert_array_equal(ours.pose_enc, theirs.pose_enc)
