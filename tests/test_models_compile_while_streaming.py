"""A compiled model's code made beside its stream (models/builds/while_streaming.py), the stream stepping
as written meanwhile (`steps_eagerly`), and the run's switch between frames (models/builds/plan.py).

Here on the CPU the model is uncompiled (compiled models are CUDA's): what is checked is the thread, the
supervision contract and the switch; tests/test_gpu_fast_path.py checks a compiled model's switch and its
outputs, and tests/test_compilation.py that a thread running eagerly leaves another one compiling."""

from __future__ import annotations

import dataclasses
import logging
import threading

import numpy as np
import pytest
import torch

from stream_recon.models import ChunkedEngine, StreamConfig, StreamingEngine
from stream_recon.models.builds import compilation
from stream_recon.models.builds import plan as builds_module
from stream_recon.models.builds import while_streaming as compile_while_streaming
from stream_recon.models.builds.plan import Builder, BuildSettings, CompileChoice
from stream_recon.models.builds.while_streaming import CompileWhileStreaming
from stream_recon.models.network import step_mode
from stream_recon.models.network.gct import GCTStream
from stream_recon.models.supervision import Deadline

CONFIG = StreamConfig(scale_frames=3, window=4)


def frame(index: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(index).integers(0, 255, (3, 28, 42), dtype=np.uint8))


def test_its_steps_run_on_a_thread_of_their_own_and_it_is_ready_when_they_end(prepared_tiny_model, monkeypatch):
    steps = []
    step = GCTStream.step

    def watched(model, *args, **kwargs):
        steps.append((threading.current_thread().name, step_mode.as_written()))
        return step(model, *args, **kwargs)

    monkeypatch.setattr(GCTStream, "step", watched)
    making = CompileWhileStreaming(prepared_tiny_model, CONFIG, frame(0))
    making.end(Deadline(60.0))
    assert making.ready and making.helper.is_up and making.seconds > 0
    assert {name for name, _ in steps} == {"compile-while-streaming"}
    # its streaming steps run as the model was prepared, not as written; its scale step as written, as always
    assert [eager for _, eager in steps] == [True] + [False] * (len(steps) - 1) and len(steps) > 1


def test_one_that_raises_is_down_with_its_reason_and_never_ready(prepared_tiny_model, monkeypatch, caplog):
    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(GCTStream, "step", no_room)
    with caplog.at_level(logging.WARNING):
        making = CompileWhileStreaming(prepared_tiny_model, CONFIG, frame(0))
        making.end(Deadline(60.0))
    assert not making.ready and making.helper.down_reason == "OutOfMemoryError: CUDA out of memory"
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "compiling while the stream runs is off for the rest of the run: OutOfMemoryError: CUDA out of memory"]


def test_one_that_stalls_is_down_at_its_deadline_and_the_caller_never_waits(prepared_tiny_model, monkeypatch):
    release = threading.Event()
    step = GCTStream.step

    def stalls(model, *args, **kwargs):
        release.wait(timeout=60)
        return step(model, *args, **kwargs)

    monkeypatch.setattr(GCTStream, "step", stalls)
    monkeypatch.setattr(compile_while_streaming, "POLICY", dataclasses.replace(compile_while_streaming.POLICY,
                                                                               stall_s=0.2))
    making = CompileWhileStreaming(prepared_tiny_model, CONFIG, frame(0))
    started = Deadline(10.0)
    while making.helper.is_up and not started.expired:
        assert not making.ready  # each ask returns at once
    assert making.helper.down_reason == "it made no progress for 0.2 s" and not making.ready
    release.set()
    making.end(Deadline(60.0))
    assert not making.ready  # done after its deadline: still off


@pytest.mark.parametrize("engine_kind", ["streaming", "chunked"])
def test_an_engine_stepping_eagerly_predicts_what_it_predicts_as_prepared(prepared_tiny_model, engine_kind,
                                                                          monkeypatch):
    seen = []
    step = GCTStream.step

    def watched(model, *args, **kwargs):
        seen.append(step_mode.as_written())
        return step(model, *args, **kwargs)

    def make():
        if engine_kind == "chunked":
            return ChunkedEngine(prepared_tiny_model, CONFIG, chunk_frames=8, overlap=2, lookahead=False)
        return StreamingEngine(prepared_tiny_model, CONFIG)

    frames = [frame(i) for i in range(12)]
    usual = make()
    expected = [p for f in frames for p in usual.push(f)] + list(usual.finish())
    monkeypatch.setattr(GCTStream, "step", watched)
    engine = make()
    engine.steps_eagerly(True)
    got = [p for f in frames[:6] for p in engine.push(f)]
    eager_steps = len(seen)
    engine.steps_eagerly(False)
    got += [p for f in frames[6:] for p in engine.push(f)] + list(engine.finish())
    assert all(seen[:eager_steps]) and eager_steps >= 4
    assert not all(seen[eager_steps:])  # as prepared again (scale steps of later chunks stay as written)
    assert [p.frame_index for p in got] == [p.frame_index for p in expected]
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a.depth, b.depth, rtol=1e-5, atol=1e-6)


def cpu_builder_of_a_compiled_size() -> Builder:
    """A CPU run's builder as a CUDA run's of a size compiled here would be (the model stays uncompiled)."""
    builds = Builder(BuildSettings("auto", "off", None, 3, "cpu", torch.float32, engine_config=CONFIG),
                     say=lambda line: None)
    builds.facts.choice, builds.facts.compiled_here = CompileChoice(True), True
    return builds


def test_a_run_of_a_size_compiled_here_streams_as_written_until_its_code_is_made_then_compiled(
        prepared_tiny_model, monkeypatch):
    """The builder's part of it: the engine steps as written from the first frame, CompileWhileStreaming starts
    after the warm-up, and between frames the engine is switched once it is ready; run.json says from which
    frame. (On the CPU the model is not compiled; whether a run compiles while it streams is the choice's,
    checked below.)"""
    builds = cpu_builder_of_a_compiled_size()
    engine = ChunkedEngine(prepared_tiny_model, CONFIG, chunk_frames=8, overlap=2, lookahead=False)
    frames = [frame(i) for i in range(40)]
    assert builds.before_stream(engine, frames[0], None) is None  # (--warm-up off)
    assert engine.eager_steps and builds.while_streaming is not None
    assert builds.summary()["compiled_while_streaming"]["from_frame"] is None
    builds.while_streaming.end(Deadline(60.0))  # (so that the switch comes after the first frame)
    assert engine.eager_steps  # nothing switches it but the run loop, between frames
    for index, image in enumerate(frames, 1):
        engine.push(image)
        builds.after_frame(engine, index)
    assert builds.compiled_from_frame == 1 and not engine.eager_steps
    assert builds.summary()["compiled_while_streaming"] == {
        "from_frame": 1, "seconds": builds.while_streaming.seconds, "off": None}
    assert builds.finish(stopped_by_signal=False) is None


@pytest.mark.parametrize(("compiled", "budget", "recorded", "expected"), [
    ("on", None, True, True), ("auto", None, True, True),
    ("auto", None, False, False),  # not compiled here: uncompiled, its size compiled beside the run
    ("on", None, False, False),  # asked for, on a size not compiled here: compiled before the stream
    ("auto", "8GiB", True, False),  # under a memory budget
    ("off", None, True, False)])
def test_a_run_compiles_while_it_streams_where_a_size_compiled_here_is_compiled(monkeypatch, compiled, budget,
                                                                                 recorded, expected):
    monkeypatch.setattr(builds_module, "run_key", lambda *args: "the key")
    monkeypatch.setattr(compilation, "recorded", lambda key, what: recorded and what == "compiled")
    builds = Builder(BuildSettings(compiled, "auto", budget, 8, "cuda", torch.bfloat16, engine_config=CONFIG,
                                   input_size=(392, 518)), say=lambda line: None)
    assert builds.runs("compile_while_streaming") is expected


def test_a_stream_known_to_be_short_steps_as_written_to_its_end_and_compiles_nothing(prepared_tiny_model):
    builds = cpu_builder_of_a_compiled_size()
    engine = ChunkedEngine(prepared_tiny_model, CONFIG, chunk_frames=8, overlap=2, lookahead=False)
    short = builds_module.WHILE_STREAMING_MIN_FRAMES
    builds.before_stream(engine, frame(0), short)
    for index in range(1, 6):
        engine.push(frame(index))
        builds.after_frame(engine, index)
    assert engine.eager_steps and builds.while_streaming is None
    assert builds.summary()["compiled_while_streaming"] == {
        "from_frame": None, "seconds": None,
        "off": f"the stream is {short} frames, not more than {short}: it steps as written"}
