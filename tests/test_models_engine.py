"""Streaming engine paths on the tiny model (fast): phases, policies, rollback, bad input."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_tiny_model
from engine_helpers import DESCRIBED_POLICY, assert_streams_like_the_visible_set_model, frames, policy_beside
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_recon.models import (
    FRAME_KEY,
    FRAME_NON_KEY,
    FRAME_SCALE,
    FrameError,
    ModelConfig,
    StreamConfig,
    StreamingEngine,
    prepare_for_inference,
)
from stream_recon.models.stream import keyframes
from stream_recon.models.stream.keyframe_policy import PREDICTION, SIGNALS, TOKENS, FrameFacts
from stream_recon.models.stream.keyframes import parse_keyframes
from stream_recon.models.stream.keyframes.all import AllKeyframes
from stream_recon.models.stream.keyframes.flow import FLOW_THRESHOLD, MAX_GAP, FlowKeyframes
from stream_recon.models.stream.keyframes.interval import IntervalKeyframes
from stream_recon.models.stream.steps import EagerRunner


def run(model, config: StreamConfig, images) -> tuple[list, StreamingEngine]:
    engine = StreamingEngine(model, config)
    predictions = []
    for i, image in enumerate(images):
        predictions += engine.push(image, timestamp=0.5 * i)
    predictions += engine.finish()
    return predictions, engine


def test_phases_and_outputs(prepared_tiny_model):
    predictions, engine = run(prepared_tiny_model, StreamConfig(scale_frames=3, window=2), frames(9))
    assert [p.frame_index for p in predictions] == list(range(9))
    assert [p.frame_type for p in predictions] == [FRAME_SCALE] * 3 + [FRAME_KEY] * 6
    assert [p.timestamp for p in predictions] == [0.5 * i for i in range(9)]
    p = predictions[4]
    assert p.pose_enc.shape == (9,) and p.c2w.shape == (3, 4) and p.intrinsics.shape == (3, 3)
    assert p.depth.shape == (42, 56) and p.depth_conf.shape == (42, 56) and p.image.shape == (42, 56, 3)
    assert p.image_size == (42, 56) and np.isfinite(p.depth).all() and (p.depth_conf >= 1).all()
    stats = engine.stats()
    assert stats["cached_frames"] == 9 and stats["patch_frames"] == 5 and stats["camera_tokens"] == 9


def test_scale_frames_are_returned_together(prepared_tiny_model):
    engine = StreamingEngine(prepared_tiny_model, StreamConfig(scale_frames=3, window=2))
    images = frames(4)
    assert engine.push(images[0]) == [] and engine.push(images[1]) == []
    assert [p.frame_index for p in engine.push(images[2])] == [0, 1, 2]
    assert [p.frame_index for p in engine.push(images[3])] == [3]


def test_short_stream_is_flushed_by_finish(prepared_tiny_model):
    predictions, _ = run(prepared_tiny_model, StreamConfig(scale_frames=4, window=2), frames(2))
    assert [p.frame_type for p in predictions] == [FRAME_SCALE, FRAME_SCALE]


@pytest.mark.parametrize(("attention", "kv_cache", "lent"), [("sdpa", "auto", True), ("sdpa", "fp8", True),
                                                           ("sdpa", "auto", False)])
@pytest.mark.slow
def test_an_engine_goes_on_with_a_stream_it_takes_over(prepared_tiny_model, attention, kv_cache, lent):
    """`take_over`: an engine continues another's stream (a spare's chunk, here one whose pool holds
    pages for 2 of the window's 4 frames, lent by the current engine's storage as a chunk's spare's are, or
    in a storage of its own) as that engine would have; while a frame is still to be predicted and delivered
    (a scale frame buffered), or from a stream of another size, it is refused."""
    from stream_recon.models.stream.memory import cache_pages

    config = StreamConfig(scale_frames=2, window=4, attention=attention, kv_cache=kv_cache)
    images = frames(12)
    expected, _ = run(prepared_tiny_model, config, images)
    current = StreamingEngine(prepared_tiny_model, config)
    if lent:
        current.lend_pages(cache_pages(prepared_tiny_model, config, tuple(images[0].shape[1:]), window_slots=2))
    current.push(images[11])  # a stream of its own, dropped by the take-over (its first frame sets it up)
    spare = StreamingEngine(prepared_tiny_model, config, window_slots=2, pages_of=current.cache if lent else None)
    predictions = []
    for i, image in enumerate(images[:4]):  # 2 scale frames, 2 window frames: the spare's slots are full
        predictions += spare.push(image, timestamp=0.5 * i)
        current.push(images[10 - i])
    assert (spare.cache.storage is current.cache.storage) == lent
    assert spare.cache.bytes_allocated == (0 if lent else spare.cache.storage.bytes_allocated)
    assert (spare.cache.store_dtype == torch.float8_e4m3fn) == (kv_cache == "fp8")
    buffering = StreamingEngine(prepared_tiny_model, config)
    buffering.push(images[0])
    with pytest.raises(ValueError, match="delivered every prediction"):
        buffering.take_over(spare)
    predictions += spare.finish()
    current.finish()
    current.reset()
    current.take_over(spare)
    for i, image in enumerate(images[4:], start=4):
        predictions += current.push(image, timestamp=0.5 * i)
    predictions += current.finish()
    assert [p.frame_index for p in predictions] == [p.frame_index for p in expected] == list(range(12))
    for ours, theirs in zip(predictions, expected, strict=True):
        np.testing.assert_array_equal(ours.depth, theirs.depth)
        np.testing.assert_array_equal(ours.pose_enc, theirs.pose_enc)
    other_size = StreamingEngine(prepared_tiny_model, config)
    for _ in range(2):  # its scale frames, predicted and delivered
        other_size.push(torch.rand(3, 28, 56))
    with pytest.raises(ValueError, match="frame size"):
        other_size.take_over(spare)


@pytest.mark.parametrize("attention", ["sdpa"])
def test_rolled_back_frames_leave_no_trace(prepared_tiny_model, attention):
    """With interval:2, every keyframe's output equals a stream that never saw the non-keyframes."""
    images = frames(11, seed=1)
    config = StreamConfig(scale_frames=3, window=2, keyframes="interval:2", attention=attention)
    with_drops, engine = run(prepared_tiny_model, config, images)
    kept = [images[i] for i in range(11) if i < 3 or (i - 3) % 2 == 0]
    only_keyframes, _ = run(prepared_tiny_model, StreamConfig(scale_frames=3, window=2, attention=attention), kept)
    keyframes = [p for p in with_drops if p.frame_type != FRAME_NON_KEY]
    assert [p.frame_type for p in with_drops][3:] == [FRAME_KEY, FRAME_NON_KEY] * 4
    for ours, reference in zip(keyframes, only_keyframes, strict=True):
        np.testing.assert_allclose(ours.pose_enc, reference.pose_enc, rtol=0, atol=1e-6)
        np.testing.assert_allclose(ours.depth, reference.depth, rtol=0, atol=1e-6)
    assert engine.stats()["cached_frames"] == len(kept)
    assert engine.stats()["camera_tokens"] == len(kept)


@pytest.mark.parametrize("attention", ["sdpa"])
def test_the_cache_attends_over_the_specs_visible_set(prepared_tiny_model, attention):
    """The cache attends over exactly the spec's key set (scale + window + all specials)."""
    images = frames(10, seed=2)
    streamed, _ = run(prepared_tiny_model, StreamConfig(scale_frames=2, window=3, attention=attention), images)
    assert_streams_like_the_visible_set_model(prepared_tiny_model, streamed, images, scale_frames=2, window=3)


@pytest.mark.parametrize("attention", ["sdpa"])
def test_flow_policy_decides_and_reports_flow(prepared_tiny_model, attention):
    predictions, engine = run(prepared_tiny_model, StreamConfig(scale_frames=3, window=2, keyframes="flow", flow_threshold=1e9,
                                                       max_gap=3, attention=attention), frames(12, seed=3))
    types = [p.frame_type for p in predictions]
    # Threshold never reached: keyframes come from the first-frame rule and the gap limit alone.
    assert types == [0, 0, 0, 1, 2, 2, 1, 2, 2, 1, 2, 2]
    assert all(np.isfinite(p.flow_magnitude) for p in predictions[3:])
    assert engine.stats()["cached_frames"] == 6


@pytest.mark.parametrize("text, expected", [("all", AllKeyframes()), (" interval:3", IntervalKeyframes(3)),
                                           ("FLOW", FlowKeyframes(FLOW_THRESHOLD, MAX_GAP))])
def test_policy_parsing(text, expected):
    assert parse_keyframes(text) == expected


@pytest.mark.parametrize("text", ["interval:0", "interval:x", "interval", "all:2", "flow:", "sometimes", ""])
def test_policy_parsing_rejects(text):
    with pytest.raises(ValueError, match=r"unknown keyframe policy .*: use all, flow or interval:N \(N >= 1\)"):
        parse_keyframes(text)


def test_flow_settings_out_of_range_are_refused_for_the_flow_policy_only():
    with pytest.raises(ValueError, match=r"flow keyframes need flow_threshold > 0 and max_gap >= 1, got 0.0, 3"):
        parse_keyframes("flow", 0.0, 3)
    assert parse_keyframes("interval:2", 0.0, 0) == IntervalKeyframes(2)


# -- the policies against the string-kind formulas they replaced, written out here as the reference ----------
def reference_parse(text: str) -> tuple[str, int] | None:
    """(kind, interval) of a spelling, None for one that is refused."""
    text = text.strip().lower()
    if text in ("all", "flow"):
        return text, 1
    if text.startswith("interval:"):
        try:
            interval = int(text.split(":", 1)[1])
        except ValueError:
            interval = 0
        if interval >= 1:
            return "interval", interval
    return None


def reference_decided_before(kind: str, interval: int, index: int, scale_frames: int) -> bool | None:
    if kind == "flow":
        return None
    return kind == "all" or (index - scale_frames) % interval == 0


def reference_decided_after(flow_threshold: float, max_gap: int, flow: float, index: int, last_key_index: int,
                            scale_frames: int) -> bool:
    return index == scale_frames or flow > flow_threshold or index - last_key_index >= max_gap


spellings = st.one_of(
    st.sampled_from(["all", "flow", "ALL", " Flow ", "interval:1", "interval:07", "interval: 5", "interval:+3",
                     "interval:1_0", "interval:-2", "interval:", "interval", "all:", "flow:1"]),
    st.builds(lambda word, number: f"{word}:{number}", st.sampled_from(["interval", "INTERVAL", "all", "flow"]),
              st.integers(-3, 10**6)),
    st.text(alphabet="alfowintervAFI:0123456789 -+_", max_size=14),
)
flow_thresholds = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False)
max_gaps = st.integers(1, 1000)
policies = st.one_of(st.just(AllKeyframes()), st.builds(IntervalKeyframes, st.integers(1, 10**6)),
                     st.builds(FlowKeyframes, flow_thresholds, max_gaps))


@settings(max_examples=150, deadline=None)
@given(policy=policies, flow_threshold=flow_thresholds, max_gap=max_gaps)
def test_a_policy_parses_back_from_its_spelling(policy, flow_threshold, max_gap):
    if isinstance(policy, FlowKeyframes):  # the flow settings are flags of their own, not in the spelling
        flow_threshold, max_gap = policy.flow_threshold, policy.max_gap
    spelling = f"interval:{policy.interval}" if isinstance(policy, IntervalKeyframes) else policy.word
    assert parse_keyframes(spelling, flow_threshold, max_gap) == policy
    assert parse_keyframes(spelling.upper(), flow_threshold, max_gap) == policy


@settings(max_examples=200, deadline=None)
@given(text=spellings, flow_threshold=flow_thresholds, max_gap=max_gaps,
       steps=st.lists(st.tuples(st.integers(0, 400), st.integers(1, 16), st.integers(0, 400),
                                st.floats(allow_nan=True, allow_infinity=True)), min_size=1, max_size=8))
def test_policies_decide_as_the_string_kinds_did(text, flow_threshold, max_gap, steps):
    expected = reference_parse(text)
    if expected is None:
        with pytest.raises(ValueError, match="unknown keyframe policy"):
            parse_keyframes(text, flow_threshold, max_gap)
        return
    kind, interval = expected
    policy = parse_keyframes(text, flow_threshold, max_gap)
    # the chunked engine's questions: whether a chunk closes on its keyframes, its input frames per cached one
    assert policy.closes_on_keyframes == (kind == "flow")
    assert (policy.input_frames_per_cached_frame or 1) == (interval if kind == "interval" else 1)
    assert policy.reads_flow_threshold == (kind == "flow")
    for index, scale_frames, last_key_index, flow in steps:
        before = FrameFacts(index, scale_frames, 0.0, last_key_index, 0.0)
        assert policy.decided_before(before) == reference_decided_before(kind, interval, index, scale_frames)
        if kind == "flow":
            assert policy.decided_after(dataclasses.replace(before, flow=flow)) == reference_decided_after(
                flow_threshold, max_gap, flow, index, last_key_index, scale_frames)


def test_the_folder_of_policies_is_the_table():
    """Adding a keyframe policy is one file in models/stream/keyframes/: its word is the file's name."""
    folder = Path(keyframes.__file__).parent
    files = sorted(path.stem for path in folder.glob("*.py") if path.stem != "__init__")
    assert len(files) >= 3 and keyframes.names() == tuple(files) == tuple(keyframes.keyframe_policies())
    for word, policy in keyframes.keyframe_policies().items():
        assert policy.word == word and policy.__module__ == f"stream_recon.models.stream.keyframes.{word}"
        assert policy.reads <= set(SIGNALS)
    assert keyframes.keyframe_spellings() == "all, flow or interval:N (N >= 1)"


# A policy that decides from the frame's prediction, as a user would add it: one file beside the others.
CONFIDENT_POLICY = '''"""`confident:T`: a keyframe when the frame's mean depth confidence (or its tokens' mean) is at least T."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stream_recon.models.stream.keyframe_policy import PREDICTION, TOKENS, FrameFacts, KeyframePolicy

TOLD: list[FrameFacts] = []  # what the engine told it, for the test to read


@dataclass(frozen=True)
class ConfidentKeyframes(KeyframePolicy):
    threshold: float
    word: ClassVar[str] = "confident"
    usage: ClassVar[str] = "confident:T"
    reads: ClassVar[frozenset[str]] = frozenset({PREDICTION})

    def decided_before(self, frame: FrameFacts) -> bool | None:
        return None

    def decided_after(self, frame: FrameFacts) -> bool:
        TOLD.append(frame)
        read = frame.prediction["depth_conf"] if frame.prediction is not None else frame.tokens
        return float(read.mean()) >= self.threshold

    @classmethod
    def from_argument(cls, argument, flow_threshold, max_gap):
        return cls(float(argument)) if argument else None
'''


@pytest.fixture(params=[PREDICTION])
def policy_beside_the_others(request, tmp_path):
    """CONFIDENT_POLICY, reading the signal the test asks for, written as a file in a folder of the keyframes
    package's path: the table then holds it."""
    with policy_beside(tmp_path, "confident", CONFIDENT_POLICY.replace("frozenset({PREDICTION})",
                                                                      f"frozenset({{{request.param.upper()}}})")):
        yield


def test_a_policy_that_reads_the_frames_prediction_is_one_file(prepared_tiny_model, policy_beside_the_others):
    """The engine tells a policy what it reads (here the prediction, so no flow and no tokens), and the policy
    alone decides: each streaming frame is a keyframe exactly when its own prediction says so."""
    assert "confident:T" in keyframes.keyframe_spellings()
    images = frames(12, seed=5)
    everything, _ = run(prepared_tiny_model, StreamConfig(scale_frames=3, window=3), images)
    threshold = float(np.median([p.depth_conf.mean() for p in everything[3:]]))
    predictions, engine = run(prepared_tiny_model, StreamConfig(scale_frames=3, window=3,
                                                                keyframes=f"confident:{threshold!r}"), images)
    told = sys.modules["stream_recon.models.stream.keyframes.confident"].TOLD
    assert [facts.index for facts in told] == list(range(3, 12))
    assert all(facts.flow is None and facts.tokens is None and facts.timestamp == 0.5 * facts.index
               for facts in told)
    streamed = predictions[3:]
    keys = [p.frame_type == FRAME_KEY for p in streamed]
    assert keys == [bool(p.depth_conf.mean() >= threshold) for p in streamed] and 0 < sum(keys) < len(keys)
    assert all(np.isnan(p.flow_magnitude) for p in streamed)  # the flow, which it does not read, is not computed
    assert engine.stats()["keyframes"] == 3 + sum(keys)


@pytest.mark.parametrize("policy_beside_the_others", [TOKENS], indirect=True)
def test_a_policy_that_reads_the_frames_tokens_is_told_its_descriptor(prepared_tiny_model, policy_beside_the_others):
    """Reading the tokens makes the engine's steps make each frame's descriptor, and tells the policy that alone."""
    predictions, _ = run(prepared_tiny_model, StreamConfig(scale_frames=3, window=3, keyframes="confident:0"),
                         frames(6, seed=5))
    told = sys.modules["stream_recon.models.stream.keyframes.confident"].TOLD
    assert [facts.index for facts in told] == [3, 4, 5]
    for facts, prediction in zip(told, predictions[3:], strict=True):
        assert facts.prediction is None and facts.flow is None
        np.testing.assert_array_equal(facts.tokens, prediction.descriptor)


def test_every_engine_shares_one_parse_of_a_spelling():
    config = StreamConfig(keyframes="Flow", flow_threshold=2.5, max_gap=4)
    assert config.policy is dataclasses.replace(config, window=3).policy is parse_keyframes("Flow", 2.5, 4)


def test_bad_frames_are_named(prepared_tiny_model):
    engine = StreamingEngine(prepared_tiny_model, StreamConfig(scale_frames=2, window=2))
    with pytest.raises(FrameError, match="torch.Tensor or numpy array"):
        engine.push("frame.png")
    with pytest.raises(FrameError, match=r"shape \[3, H, W\]"):
        engine.push(torch.rand(42, 56, 3))
    with pytest.raises(FrameError, match="uint8 or float"):
        engine.push(torch.ones(3, 42, 56, dtype=torch.int32))
    with pytest.raises(FrameError, match="not a multiple of the 14-pixel patch"):
        engine.push(torch.rand(3, 40, 56))
    engine.push(torch.rand(3, 42, 56))
    engine.push(torch.rand(3, 42, 56))
    with pytest.raises(FrameError, match="frame 2 is 56x56 but the stream started at 42x56"):
        engine.push(torch.rand(3, 56, 56))
    # The stream goes on after a rejected frame.
    assert len(engine.push(torch.rand(3, 42, 56))) == 1


def test_uint8_frames_are_accepted(prepared_tiny_model):
    image = (torch.rand(3, 42, 56) * 255).to(torch.uint8)
    a, _ = run(prepared_tiny_model, StreamConfig(scale_frames=1, window=2), [image])
    b, _ = run(prepared_tiny_model, StreamConfig(scale_frames=1, window=2), [image.float() / 255])
    np.testing.assert_array_equal(a[0].depth, b[0].depth)


def test_temporal_limit_is_a_clear_error():
    config = ModelConfig.from_dict({**ModelConfig.tiny().to_dict(), "max_frames": 4})
    model = prepare_for_inference(build_tiny_model(config))
    engine = StreamingEngine(model, StreamConfig(scale_frames=2, window=2))
    for image in frames(4):
        engine.push(image)
    with pytest.raises(ValueError, match="past the model's 4-position RoPE table"):
        engine.push(frames(1)[0])
    # Nothing of the refused frame stays behind.
    assert engine.cache.num_pending_frames == 0 and engine.stats()["cached_frames"] == 4


def test_stats_have_the_same_keys_before_the_first_frame(prepared_tiny_model):
    engine = StreamingEngine(prepared_tiny_model, StreamConfig(scale_frames=1, window=2))
    before = engine.stats()
    engine.push(frames(1)[0])
    assert set(before) == set(engine.stats())


def test_graph_recording_pauses_the_cycle_collector_and_restores_it():
    """A collection inside a CUDA-graph capture can free objects whose CUDA calls invalidate it;
    the recording collects first, pauses the collector, and restores it even when capture fails."""
    import gc

    from stream_recon.models.stream.graphs import _collector_paused

    assert gc.isenabled()
    with _collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), _collector_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with _collector_paused():
            pass
        assert not gc.isenabled()  # a collector the caller had paused stays paused
    finally:
        gc.enable()


class LaggedEagerRunner(EagerRunner):
    """An eager runner whose frames the engine collects one push late, as it does a pipelined one's
    (PipelinedRunner needs CUDA): the engine's delivery and late-decision logic on the CPU."""

    lag = 1


@pytest.mark.parametrize("keyframes", ["all", "interval:2", "flow"])
@pytest.mark.slow
def test_a_runner_that_holds_a_frame_gives_the_same_stream_one_push_late(prepared_tiny_model, monkeypatch,
                                                                         keyframes):
    from stream_recon.models.stream import engine as engine_module

    # flow: the tiny model's flows are all small, so the gap rule makes both decisions happen
    config = StreamConfig(scale_frames=3, window=2, keyframes=keyframes, flow_threshold=1e9, max_gap=3)
    images = frames(12, seed=5)
    synchronous, _ = run(prepared_tiny_model, config, images)
    monkeypatch.setattr(engine_module, "choose_runner", lambda *args, **kwargs: LaggedEagerRunner(*args[:5]))
    engine = StreamingEngine(prepared_tiny_model, config)
    per_push = [engine.push(image, timestamp=0.5 * i) for i, image in enumerate(images)]
    tail = engine.finish()
    assert [[p.frame_index for p in push] for push in per_push[2:5]] == [[0, 1, 2], [], [3]]
    assert [p.frame_index for p in tail] == [11]
    lagged = [p for push in per_push for p in push] + tail
    assert [p.frame_index for p in lagged] == list(range(12)) == [p.frame_index for p in synchronous]
    assert [p.frame_type for p in lagged] == [p.frame_type for p in synchronous]
    if keyframes == "flow":
        assert set([p.frame_type for p in lagged][3:]) == {FRAME_KEY, FRAME_NON_KEY}  # both decisions occur
    for ours, reference in zip(lagged, synchronous, strict=True):
        np.testing.assert_array_equal(ours.depth, reference.depth)
        np.testing.assert_array_equal(ours.pose_enc, reference.pose_enc)
        assert ours.flow_magnitude == reference.flow_magnitude or np.isnan(reference.flow_magnitude)
    assert engine.stats()["cached_frames"] == sum(p.is_keyframe for p in synchronous)


@pytest.mark.parametrize("spelling", ["all", "flow"])
def test_descriptors_come_with_each_prediction_and_change_nothing_else(prepared_tiny_model, spelling, tmp_path):
    """A policy that reads the frame's tokens: every prediction carries GeM of its frame's DINO patch tokens
    (unit length), and every other output is what the stream gives without them, bit for bit."""
    from stream_recon.models.network.descriptor import gem_descriptor

    config = StreamConfig(scale_frames=3, window=2, keyframes=spelling, flow_threshold=0.5)
    images = frames(8)
    plain, _ = run(prepared_tiny_model, config, images)
    with policy_beside(tmp_path, "described", DESCRIBED_POLICY):
        described, _ = run(prepared_tiny_model, dataclasses.replace(config, keyframes=f"described:{spelling}"),
                           images)
    assert [p.frame_index for p in described] == [p.frame_index for p in plain]
    for ours, theirs in zip(described, plain, strict=True):
        assert theirs.descriptor is None
        for name in ("pose_enc", "c2w", "intrinsics", "depth", "depth_conf", "image"):
            np.testing.assert_array_equal(getattr(ours, name), getattr(theirs, name))
        assert ours.frame_type == theirs.frame_type
    model = prepared_tiny_model
    with torch.inference_mode():
        tokens = model.aggregator.embed(torch.stack(images), torch.arange(8), 3)
    expected = gem_descriptor(tokens[:, model.config.num_special_tokens:]).numpy()
    got = np.stack([p.descriptor for p in described])
    assert got.shape == (8, model.config.embed_dim)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
