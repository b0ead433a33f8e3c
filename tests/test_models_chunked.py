"""ChunkedEngine on the tiny model, and its Sim(3) helpers against float64 numpy references.

The stitched result is checked against an offline version of the reference's `inference_windowed`
written here from spec §14: every window run by its own fresh StreamingEngine, aligned with 4x4
matrices and stitched with the later window winning.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time

import numpy as np
import pytest
import torch
from engine_helpers import SpareGate
from helpers import chunk_scales, chunk_transforms, random_sim3
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_recon.models import (
    ChunkedEngine,
    FrameError,
    StreamConfig,
    StreamingEngine,
)
from stream_recon.models.stream import chunked, keyframes
from stream_recon.models.stream.keyframes.interval import IntervalKeyframes
from stream_recon.models.stream.pose import rotation_to_quat_xyzw
from stream_recon.models.stream.prediction import FRAME_NON_KEY
from stream_recon.models.stream.similarity import (
    FrameRatios,
    Sim3,
    depth_ratios,
    estimate_chunk_alignment,
    median_ratio_scale,
)

HEIGHT, WIDTH = 28, 42  # 2 x 3 patches



@pytest.fixture(scope="module")
def model(prepared_tiny_model):
    return prepared_tiny_model


@pytest.fixture(scope="module")
def frames():
    generator = torch.Generator().manual_seed(1)
    return torch.rand(30, 3, HEIGHT, WIDTH, generator=generator)


# -- numpy float64 references ------------------------------------------------------------------
def quat_to_matrix_reference(quat_xyzw: np.ndarray) -> np.ndarray:
    """Rodrigues' formula from the axis-angle of the normalised quaternion."""
    x, y, z, w = np.asarray(quat_xyzw, np.float64) / np.linalg.norm(quat_xyzw)
    angle = 2 * np.arctan2(np.linalg.norm([x, y, z]), w)
    axis = np.array([x, y, z]) / max(np.linalg.norm([x, y, z]), 1e-300)
    cross = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    return np.eye(3) + np.sin(angle) * cross + (1 - np.cos(angle)) * cross @ cross


def median_scale_of(target_depth: np.ndarray, source_depth: np.ndarray) -> float:
    """The median of target / source over every pixel where both are finite and the source is not ~0."""
    return median_ratio_scale([depth_ratios(target_depth, source_depth)])


def matrix_to_quat_reference(rotation: np.ndarray) -> np.ndarray:
    """Bar-Itzhack: the quaternion is the top eigenvector of a symmetric 4x4 built from R."""
    (a, b, c), (d, e, f), (g, h, i) = rotation
    k = np.array([
        [a - e - i, d + b, g + c, h - f],
        [d + b, e - a - i, h + f, c - g],
        [g + c, h + f, i - a - e, d - b],
        [h - f, c - g, d - b, a + e + i],
    ]) / 3.0
    values, vectors = np.linalg.eigh(k)
    quat = vectors[:, np.argmax(values)]  # x, y, z, w
    return quat if quat[3] >= 0 else -quat


def random_rotations(rng: np.random.Generator, count: int) -> np.ndarray:
    """Uniform, near identity and near 180 degrees (w ~ 0, where naive conversions break)."""
    uniform = rng.standard_normal((count, 4))
    small = np.concatenate([1e-4 * rng.standard_normal((count, 3)), np.ones((count, 1))], axis=1)
    half_turn = np.concatenate([rng.standard_normal((count, 3)), 1e-6 * rng.standard_normal((count, 1))], axis=1)
    quats = np.concatenate([uniform, small, half_turn])
    return np.stack([quat_to_matrix_reference(q) for q in quats])


def random_pose_enc(rng: np.random.Generator, count: int) -> np.ndarray:
    """[count, 9]; quaternions of random norm, as the network produces them."""
    quats = rng.standard_normal((count, 4)) * rng.uniform(0.3, 2.0, (count, 1))
    fov = rng.uniform(0.5, 1.2, (count, 2))
    return np.concatenate([rng.normal(0, 1, (count, 3)), quats, fov], axis=1)


def sim3_matrix(transform: Sim3) -> np.ndarray:
    out = np.eye(4)
    out[:3, :3] = transform.scale * transform.rotation
    out[:3, 3] = transform.translation
    return out


def c2w_reference(pose_enc: np.ndarray) -> np.ndarray:
    out = np.eye(4)
    out[:3, :3] = quat_to_matrix_reference(pose_enc[3:7])
    out[:3, 3] = pose_enc[:3]
    return out


# -- Sim(3) helpers ----------------------------------------------------------------------------
def test_rotation_to_quaternion_matches_the_eigenvector_method():
    rotations = random_rotations(np.random.default_rng(0), 200)
    ours = rotation_to_quat_xyzw(rotations)
    expected = np.stack([matrix_to_quat_reference(r) for r in rotations])
    # At exactly w = 0 both signs are valid; the sampled w is never that small.
    np.testing.assert_allclose(ours, expected, atol=1e-9)
    assert (ours[:, 3] >= 0).all()
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-12)
    np.testing.assert_allclose(np.stack([quat_to_matrix_reference(q) for q in ours]), rotations, atol=1e-9)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_applying_a_sim3_to_poses_matches_4x4_composition(seed):
    rng = np.random.default_rng(seed)
    transform = random_sim3(rng)
    pose_enc = random_pose_enc(rng, 5)
    moved = transform.apply_to_pose_enc(pose_enc)
    for before, after in zip(pose_enc, moved, strict=True):
        expected = sim3_matrix(transform) @ c2w_reference(before)
        np.testing.assert_allclose(after[:3], expected[:3, 3], atol=1e-9)
        np.testing.assert_allclose(c2w_reference(after)[:3, :3], expected[:3, :3] / transform.scale, atol=1e-9)
        assert abs(np.linalg.norm(after[3:7]) - np.linalg.norm(before[3:7])) < 1e-12  # the model's norm
        np.testing.assert_array_equal(after[7:], before[7:])


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 6))
def test_alignment_recovers_a_known_similarity(seed, num_shared):
    rng = np.random.default_rng(seed)
    truth = random_sim3(rng)
    source_pose = random_pose_enc(rng, num_shared)
    source_depth = rng.uniform(0.5, 5.0, (num_shared, 4, 5))
    keyframes = rng.random(num_shared) < 0.7
    target_pose = truth.apply_to_pose_enc(source_pose)
    estimate = estimate_chunk_alignment(target_pose, truth.scale * source_depth, keyframes,
                                         source_pose, source_depth, np.ones(num_shared, bool))
    assert estimate.scale == pytest.approx(truth.scale, rel=1e-6)  # float32 ratios, as the reference
    np.testing.assert_allclose(estimate.rotation, truth.rotation, atol=1e-9)
    np.testing.assert_allclose(estimate.translation, truth.translation, rtol=1e-6, atol=1e-6)


def test_alignment_uses_only_frames_that_are_keyframes_in_both_windows():
    rng = np.random.default_rng(3)
    truth = random_sim3(rng)
    source_pose = random_pose_enc(rng, 5)
    source_depth = rng.uniform(1, 2, (5, 3, 3))
    target_pose = truth.apply_to_pose_enc(source_pose)
    target_depth = truth.scale * source_depth
    # Frames 3 and 4 are not pairs (a non-keyframe in one window): their poses and depths are
    # wrong on purpose, so using them for the anchor or the scale would show.
    target_pose[3:] = random_pose_enc(rng, 2)
    target_depth[3:] *= 7.0
    target_keyframe = np.array([True, False, True, False, True])
    source_keyframe = np.array([True, True, True, True, False])
    estimate = estimate_chunk_alignment(target_pose, target_depth, target_keyframe,
                                         source_pose, source_depth, source_keyframe)
    assert estimate.scale == pytest.approx(truth.scale, rel=1e-6)  # float32 ratios, as the reference
    np.testing.assert_allclose(estimate.rotation, truth.rotation, atol=1e-9)
    np.testing.assert_allclose(estimate.translation, truth.translation, rtol=1e-6, atol=1e-6)

    # No pair at all: the first shared frame anchors everything.
    target_pose[1:] = random_pose_enc(rng, 4)
    target_depth[1:] *= 3.0
    estimate = estimate_chunk_alignment(target_pose, target_depth, np.array([False, True, False, True, False]),
                                         source_pose, source_depth, np.array([True, False, True, False, True]))
    assert estimate.scale == pytest.approx(truth.scale, rel=1e-6)  # float32 ratios, as the reference
    np.testing.assert_allclose(estimate.translation, truth.translation, atol=1e-8)


def test_depth_ratios_computed_ahead_give_the_same_alignment():
    """A window's depth ratios may be computed frame by frame before the rollover (the lookahead does):
    the alignment uses them in place of its own, and gets the same bits."""
    rng = np.random.default_rng(5)
    truth = random_sim3(rng)
    source_pose = random_pose_enc(rng, 4)
    source_depth = rng.uniform(0.5, 5.0, (4, 6, 7)).astype(np.float32)
    target_depth = (truth.scale * source_depth * rng.uniform(0.9, 1.1, source_depth.shape)).astype(np.float32)
    keyframes = np.array([True, True, False, True])
    args = (truth.apply_to_pose_enc(source_pose), list(target_depth), keyframes, source_pose, list(source_depth),
            np.ones(4, bool))
    at_once = estimate_chunk_alignment(*args)
    ahead = {k: FrameRatios.of(target_depth[k], source_depth[k]) for k in (0, 3)}
    with_ahead = estimate_chunk_alignment(*args, ratios=ahead)
    assert with_ahead.scale == at_once.scale
    assert estimate_chunk_alignment(*args, ratios={0: ahead[0]}).scale == at_once.scale  # some made ahead
    np.testing.assert_array_equal(with_ahead.translation, at_once.translation)
    doubled = {k: FrameRatios.of(2 * target_depth[k], source_depth[k]) for k in (0, 3)}
    assert estimate_chunk_alignment(*args, ratios=doubled).scale != at_once.scale
    # float32 division, as the reference's tensors divide
    assert depth_ratios(target_depth, source_depth).dtype == np.float32


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 5), st.sampled_from(["spread", "close", "ties", "signs"]))
def test_the_bisected_median_is_the_lower_median_of_all_frames(seed, num_frames, kind):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 400, num_frames)
    if kind == "spread":  # ratios over many orders of magnitude
        targets = [np.exp(rng.normal(0, 3, n)) for n in sizes]
    elif kind == "close":  # two windows' depths of one frame: ratios within a fraction of a percent
        targets = [1.3 * (1 + rng.normal(0, 1e-3, n)) for n in sizes]
    elif kind == "ties":  # few distinct values: many in one bucket
        targets = [rng.choice([0.5, 1.0, 1.0000001, 2.0], n) for n in sizes]
    else:  # both signs, zeros, infinities and NaN among them
        targets = [rng.choice([-3.0, -0.0, 0.0, 1e-30, 2.5, np.inf, -np.inf, np.nan], n) * rng.uniform(1, 2, n)
                   for n in sizes]
    frames = [(t.astype(np.float32), rng.uniform(0.5, 2.0, t.size).astype(np.float32)) for t in targets]
    everything = np.concatenate([depth_ratios(t, s) for t, s in frames])
    if everything.size == 0:
        expected = 1.0
    else:
        lower_middle = np.sort(everything)[(everything.size - 1) // 2]
        expected = float(np.clip(lower_middle, np.float32(1e-3), np.float32(1e3)))
    assert median_ratio_scale([FrameRatios.of(t, s) for t, s in frames]) == expected  # sorted beforehand
    assert median_ratio_scale([depth_ratios(t, s) for t, s in frames]) == expected  # as they are
    mixed = [FrameRatios.of(t, s) if k % 2 else depth_ratios(t, s) for k, (t, s) in enumerate(frames)]
    assert median_ratio_scale(mixed) == expected


def test_depth_ratio_scale_takes_the_lower_median_of_valid_pixels():
    target = np.array([[2.0, 3.0, 8.0, 1.0, np.nan, 5.0]])
    source = np.array([[1.0, 1.0, 2.0, 1.0, 1.0, 0.0]])  # ratios 2, 3, 4, 1; NaN and /0 skipped
    assert median_scale_of(target, source) == 2.0  # lower middle of 1 2 3 4, as torch.median
    assert median_scale_of(np.array([np.inf, 1.0]), np.array([1.0, np.nan])) == 1.0
    # clamped as the reference clamps its float32 median
    assert median_scale_of(np.array([5e4]), np.array([1.0])) == 1e3
    assert median_scale_of(np.array([1e-5]), np.array([1.0])) == float(np.float32(1e-3))


# -- the reference algorithm, offline ----------------------------------------------------------
def fixed_windows(num_frames: int, scale: int, chunk_frames: int, interval: int, overlap: int):
    """Spec §14: [start, start + L) every L - overlap frames, stop at the first that reaches the end."""
    length = min(scale + (chunk_frames - scale) * interval, num_frames)
    if length >= num_frames:
        return [(0, num_frames)]
    windows = []
    for start in range(0, num_frames, max(length - overlap, 1)):
        end = min(start + length, num_frames)
        if end - start >= overlap or end == num_frames:
            windows.append((start, end))
        if end == num_frames:
            return windows


def run_window(model, config: StreamConfig, frames: torch.Tensor, stop_after_keyframes: int | None = None):
    """One window as an independent stream; flow windows stop after enough keyframes."""
    engine = StreamingEngine(model, config)
    predictions = []
    for frame in frames:
        predictions += engine.push(frame)
        if stop_after_keyframes is not None and engine.num_keyframes >= stop_after_keyframes:
            break
    return predictions + engine.finish()


def offline_windowed(model, config: StreamConfig, frames: torch.Tensor, chunk_frames: int, overlap: int):
    """Returns {frame_index: (c2w [4, 4], quat, depth, frame_type)} stitched, and the chunk scales."""
    scale, total = config.scale_frames, len(frames)
    windows = []  # (start, raw predictions)
    if config.keyframes == "flow":  # (the reference reads the spelling itself, not the policy under test)
        cursor = 0
        while cursor < total:
            raw = run_window(model, config, frames[cursor:], stop_after_keyframes=chunk_frames)
            windows.append((cursor, raw))
            end = cursor + len(raw)
            if end < total:
                end = max(end - overlap, cursor + scale)
            cursor = end
    else:
        interval = int(config.keyframes.partition(":")[2]) if config.keyframes.startswith("interval:") else 1
        for start, end in fixed_windows(total, scale, chunk_frames, interval, overlap):
            windows.append((start, run_window(model, config, frames[start:end])))

    stitched, scales = {}, []
    for n, (start, raw) in enumerate(windows):
        if n == 0:
            similarity = np.eye(4)
        else:
            shared = [p for p in raw if p.frame_index + start in stitched]
            paired = [p for p in shared if p.is_keyframe and stitched[p.frame_index + start][3] != 2]
            anchor = paired[-1] if paired else shared[0]
            target_c2w = stitched[anchor.frame_index + start][0]
            source_c2w = c2w_reference(anchor.pose_enc.astype(np.float64))
            rotation = target_c2w[:3, :3] @ source_c2w[:3, :3].T
            ratios = np.concatenate([
                (stitched[p.frame_index + start][2].astype(np.float64) / p.depth.astype(np.float64)).ravel()
                for p in (paired or shared[:1])
            ])
            s = np.sort(ratios)[(ratios.size - 1) // 2]
            similarity = np.eye(4)
            similarity[:3, :3] = s * rotation
            similarity[:3, 3] = target_c2w[:3, 3] - s * rotation @ source_c2w[:3, 3]
        scales.append(np.cbrt(np.linalg.det(similarity[:3, :3])))
        for p in raw:
            c2w = similarity @ c2w_reference(p.pose_enc.astype(np.float64))
            c2w[:3, :3] /= scales[-1]
            stitched[start + p.frame_index] = (c2w, matrix_to_quat_reference(c2w[:3, :3]),
                                               p.depth * scales[-1], p.frame_type)
    return stitched, np.array(scales)


def run_live(engine: ChunkedEngine, frames: torch.Tensor):
    """Returns the last emission per frame and, per push, the (frame_index, chunk_index) emitted."""
    final, per_push = {}, []
    for frame in frames:
        emitted = engine.push(frame)
        per_push.append([(p.frame_index, p.chunk_index) for p in emitted])
        final.update({p.frame_index: p for p in emitted})
    emitted = engine.finish()
    per_push.append([(p.frame_index, p.chunk_index) for p in emitted])
    final.update({p.frame_index: p for p in emitted})
    return final, per_push


CASES = {
    "all": (StreamConfig(scale_frames=3, window=4), 6, 3, 14),
    "interval": (StreamConfig(scale_frames=2, window=3, keyframes="interval:2"), 4, 3, 17),
    "overlap_below_scale": (StreamConfig(scale_frames=3, window=2), 5, 2, 12),
    "flow_gap": (StreamConfig(scale_frames=2, window=3, keyframes="flow", flow_threshold=1e9, max_gap=2), 4, 2, 15),
    "flow_mixed": (StreamConfig(scale_frames=3, window=4, keyframes="flow", flow_threshold=0.8, max_gap=3), 6, 3, 20),
    "flow_clamped": (StreamConfig(scale_frames=2, window=2, keyframes="flow", flow_threshold=1e9, max_gap=1), 3, 2, 9),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_last_emissions_equal_the_offline_stitched_reference(model, frames, case):
    config, chunk_frames, overlap, count = CASES[case]
    engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap)
    final, _ = run_live(engine, frames[:count])
    expected, scales = offline_windowed(model, config, frames[:count], chunk_frames, overlap)

    assert sorted(final) == sorted(expected) == list(range(count))
    for index, (c2w, quat, depth, frame_type) in expected.items():
        ours = final[index]
        assert ours.frame_type == frame_type, index
        np.testing.assert_allclose(ours.c2w, c2w[:3], atol=2e-5)
        # the stored quaternion keeps the model's norm; as a unit quaternion with w >= 0 it is the reference's
        unit = ours.pose_enc[3:7] / np.linalg.norm(ours.pose_enc[3:7])
        np.testing.assert_allclose(unit if unit[3] >= 0 else -unit, quat, atol=2e-5)
        np.testing.assert_allclose(ours.depth, depth, rtol=2e-6)
    np.testing.assert_allclose(chunk_scales(engine), scales, rtol=1e-5)
    assert engine.stats()["rollovers"] == len(scales) - 1 == chunk_transforms(engine).shape[0] - 1
    np.testing.assert_array_equal(chunk_transforms(engine)[0], np.eye(4))


def test_interval_windows_and_frame_types_follow_the_reference_schedule(model, frames):
    config = StreamConfig(scale_frames=2, window=3, keyframes="interval:2")
    engine = ChunkedEngine(model, config, chunk_frames=4, overlap=3)  # 2 + 2 * 2 = 6 frames a window
    final, per_push = run_live(engine, frames[:17])
    windows = fixed_windows(17, 2, 4, 2, 3)
    assert windows == [(0, 6), (3, 9), (6, 12), (9, 15), (12, 17)]
    emitted = [e for push in per_push for e in push]
    assert emitted == [(i, n) for n, (start, end) in enumerate(windows) for i in range(start, end)]
    # Final types: scale frames at each window's start, then every second frame a keyframe.
    next_starts = [start for start, _ in windows[1:]] + [17]
    for (start, _), stop in zip(windows, next_starts, strict=True):
        for i in range(start, stop):
            local = i - start
            expected_type = 0 if local < 2 else (1 if (local - 2) % 2 == 0 else 2)
            assert final[i].frame_type == expected_type, i


@pytest.mark.parametrize("count, expected_windows", [(6, 1), (7, 2), (9, 2), (10, 3)])
def test_a_window_opens_only_when_a_frame_falls_beyond_the_last_one(model, frames, count, expected_windows):
    engine = ChunkedEngine(model, StreamConfig(scale_frames=3, window=4), chunk_frames=6, overlap=3)
    run_live(engine, frames[:count])
    assert engine.stats()["chunk_index"] == expected_windows - 1 == len(fixed_windows(count, 3, 6, 1, 3)) - 1


def test_flow_windows_close_after_their_keyframes_and_restart_overlap_frames_back(model, frames):
    config = StreamConfig(scale_frames=3, window=4, keyframes="flow", flow_threshold=0.8, max_gap=3)
    engine = ChunkedEngine(model, config, chunk_frames=6, overlap=3)
    windows: dict[int, list] = {}
    for frame in frames:
        for p in engine.push(frame):
            windows.setdefault(p.chunk_index, []).append(p)
    types = {n: [p.frame_type for p in ps] for n, ps in windows.items()}
    assert len(windows) >= 3 and any(2 in t for t in types.values()), types  # decisions went both ways
    for n in range(len(windows) - 1):
        current, following = windows[n], windows[n + 1]
        assert types[n][:3] == [0, 0, 0] and types[n].count(1) == 3 and types[n][-1] == 1
        end = current[-1].frame_index + 1
        assert following[0].frame_index == max(end - 3, current[0].frame_index + 3)


def test_first_emission_is_live_and_overlap_frames_are_emitted_again(model, frames):
    engine = ChunkedEngine(model, StreamConfig(scale_frames=3, window=4), chunk_frames=6, overlap=3)
    _, per_push = run_live(engine, frames[:14])
    first_push = {}
    for push_index, push in enumerate(per_push):
        for frame_index, _ in push:
            first_push.setdefault(frame_index, push_index)
    # Frames 0-2 wait for the scale phase; every later frame is out in its own push.
    assert first_push == {i: max(i, 2) for i in range(14)}
    # The push that opens a window returns the re-predicted shared frames, then the new frame.
    assert per_push[6] == [(3, 1), (4, 1), (5, 1), (6, 1)]
    assert per_push[14] == []  # finish: nothing left


def test_emissions_survive_a_bad_frame_at_a_rollover(model, frames):
    config = StreamConfig(scale_frames=3, window=4)
    reference = ChunkedEngine(model, config, chunk_frames=6, overlap=3)
    _, clean = run_live(reference, frames[:8])
    engine = ChunkedEngine(model, config, chunk_frames=6, overlap=3)
    for frame in frames[:6]:
        engine.push(frame)
    with pytest.raises(FrameError, match="14x42"):
        engine.push(frames[6][:, :14])  # the window is full: the rollover runs, then the frame is refused
    assert [(p.frame_index, p.chunk_index) for p in engine.push(frames[6])] == clean[6]
    assert [(p.frame_index, p.chunk_index) for p in engine.push(frames[7])] == clean[7]


def test_memory_is_bounded_and_the_cache_is_reused_across_windows(model, frames):
    engine = ChunkedEngine(model, StreamConfig(scale_frames=2, window=2), chunk_frames=4, overlap=2)
    for frame in frames[:4]:  # the first window, full
        engine.push(frame)
    cache, cache_bytes = engine.engine.cache, engine.stats()["cache_bytes"]
    for frame in frames[4:]:
        engine.push(frame)
        stats = engine.stats()
        assert stats["replay_frames"] <= 3  # the overlap and the frame a rollover hands the spare
        assert stats["cached_frames"] <= 4 and stats["special_pages_in_use"] <= 4
        assert engine.engine.cache is cache and stats["cache_bytes"] == cache_bytes
    # Windows of 4 frames that start 2 frames apart: [0, 4), [2, 6), ..., [26, 30).
    assert stats["rollovers"] == 13 and stats["frames"] == 30


def test_reset_starts_an_identical_stream(model, frames):
    engine = ChunkedEngine(model, StreamConfig(scale_frames=3, window=4), chunk_frames=6, overlap=3)
    backends = []
    engine.on_backend_ready = backends.append
    first, _ = run_live(engine, frames[:10])
    assert backends == ["sdpa"] and engine.device == torch.device("cpu")
    engine.reset()
    assert engine.stats()["rollovers"] == 0 and chunk_scales(engine).tolist() == [1.0]
    second, _ = run_live(engine, frames[:10])
    for index in first:
        np.testing.assert_array_equal(first[index].pose_enc, second[index].pose_enc)
        np.testing.assert_array_equal(first[index].depth, second[index].depth)


def test_rollovers_are_logged(model, frames, caplog):
    engine = ChunkedEngine(model, StreamConfig(scale_frames=3, window=4), chunk_frames=6, overlap=3)
    with caplog.at_level(logging.INFO, logger="stream_recon.models.stream.chunked"):
        run_live(engine, frames[:10])
    rollovers = [r.getMessage() for r in caplog.records if "rollover" in r.getMessage()]
    assert rollovers == [
        "chunk rollover: chunk 0 closed after frames 0-5 (6 cached); chunk 1 starts at frame 3 and re-predicts 3 frames",
        "chunk rollover: chunk 1 closed after frames 3-8 (6 cached); chunk 2 starts at frame 6 and re-predicts 3 frames",
    ]
    assert engine.stats()["chunk_index"] == 2 and engine.stats()["chunk_start"] == 6


@pytest.mark.parametrize("kwargs, message", [
    (dict(chunk_frames=3), "chunk_frames=3 must be larger than scale_frames=3"),
    (dict(chunk_frames=2000), "exceeds the model's temporal RoPE table"),
    (dict(chunk_frames=6, overlap=0), "overlap=0 must be between 1 and chunk_frames - 1 = 5"),
    (dict(chunk_frames=6, overlap=6), "overlap=6 must be between 1 and chunk_frames - 1 = 5"),
])
def test_bad_chunk_settings_are_refused(model, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ChunkedEngine(model, StreamConfig(scale_frames=3, window=4), **kwargs)


def test_the_first_window_emits_the_models_own_outputs_and_later_ones_keep_its_quaternion_norm(model, frames):
    """pose_enc in a run is the model's where no alignment applies; an aligned window's quaternion
    keeps the norm the model gave it."""
    config = StreamConfig(scale_frames=3, window=4)
    engine = ChunkedEngine(model, config, chunk_frames=6, overlap=3)
    emitted = [p for frame in frames[:12] for p in engine.push(frame)] + engine.finish()
    plain = StreamingEngine(model, config)
    raw = [p for frame in frames[:6] for p in plain.push(frame)] + plain.finish()
    first_window = [p for p in emitted if p.chunk_index == 0]
    assert [p.frame_index for p in first_window] == list(range(6))
    for ours, reference in zip(first_window, raw, strict=True):
        for key in ("pose_enc", "c2w", "intrinsics", "depth", "depth_conf"):
            np.testing.assert_array_equal(getattr(ours, key), getattr(reference, key))
    second = StreamingEngine(model, config)
    raw_second = {p.frame_index + 3: p for frame in frames[3:9] for p in second.push(frame)}
    raw_second.update({p.frame_index + 3: p for p in second.finish()})
    for ours in (p for p in emitted if p.chunk_index == 1):
        norm = np.linalg.norm(raw_second[ours.frame_index].pose_enc[3:7])
        assert abs(np.linalg.norm(ours.pose_enc[3:7]) - norm) <= 1e-6 * norm


def run_live_marked(engine: ChunkedEngine, frames: torch.Tensor):
    """run_live, with each push's emissions as (frame_index, chunk_index, provisional)."""
    final, per_push = {}, []
    for emitted in [engine.push(frame) for frame in frames] + [engine.finish()]:
        per_push.append([(p.frame_index, p.chunk_index, p.provisional) for p in emitted])
        final.update({p.frame_index: p for p in emitted})
    return final, per_push


def check_beside_the_stream(with_spare, in_place) -> None:
    """The emissions of a run with a spare against a run with rollovers in place (run_live_marked's):
    the same final emissions in the same order, the same last emission of every frame, and no frame
    first emitted later than in place but for the push a rollover beside the spare defers."""
    (final, pushes), (final_in_place, pushes_in_place) = with_spare, in_place
    finals = [(f, w) for push in pushes for f, w, provisional in push if not provisional]
    assert finals == [(f, w) for push in pushes_in_place for f, w, _ in push]
    first_push, first_push_in_place, provisional_windows = {}, {}, {}
    for where, runs in ((first_push, pushes), (first_push_in_place, pushes_in_place)):
        for index, push in enumerate(runs):
            for frame, _, _ in push:
                where.setdefault(frame, index)
    for index, push in enumerate(pushes):
        for frame, window, provisional in push:
            if provisional:  # before any final emission of the frame, from an earlier window than the final one
                assert frame not in {f for p in pushes[:index + 1] for f, _, prov in p if not prov}
                provisional_windows[frame] = window
    assert all(window < final[frame].chunk_index for frame, window in provisional_windows.items())
    assert all(first_push[frame] <= first_push_in_place[frame] + 1 for frame in first_push_in_place)
    for index, ours in final.items():
        theirs = final_in_place[index]
        assert not ours.provisional
        assert (ours.chunk_index, ours.frame_type) == (theirs.chunk_index, theirs.frame_type)
        for key in ("pose_enc", "c2w", "depth", "depth_conf"):
            np.testing.assert_array_equal(getattr(ours, key), getattr(theirs, key))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.slow
def test_a_spare_engine_beside_the_stream_ends_with_what_rollovers_in_place_emit(model, frames, case):
    """The next window predicted on a spare (on a worker thread; ahead of the rollover when windows
    close at a known frame, from the rollover for flow windows): the same final emissions in the same
    order and values as rollovers in place, a reset and a second stream too; provisional emissions of
    the closed window in between, each before the frame's final one."""
    config, chunk_frames, overlap, count = CASES[case]
    count = min(len(frames), 3 * count)
    runs = {}
    for lookahead in (False, True):
        engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=lookahead)
        first = run_live_marked(engine, frames[:count])
        engine.reset()
        second = run_live_marked(engine, frames[1:count])
        runs[lookahead] = (first, second, engine.stats())
        engine.close()
    (*in_place, stats_in_place), (*beside, stats_beside) = runs[False], runs[True]
    assert stats_beside["lookahead"] and not stats_in_place["lookahead"]
    assert stats_beside["rollovers"] == stats_in_place["rollovers"] >= 2
    assert stats_beside["rollovers_ahead"] >= 1 and stats_in_place["rollovers_ahead"] == 0
    assert stats_beside["spare_warm_up_s"] > 0 and stats_in_place["spare_warm_up_s"] is None
    assert stats_in_place["provisional_frames"] == 0
    if chunk_frames - overlap - 1 > 0:  # room for provisional frames: the rollover's own frame at least
        assert stats_beside["provisional_frames"] >= 1
    for with_spare, without in zip(beside, in_place, strict=True):
        check_beside_the_stream(with_spare, without)


SMALL_SPARE_CASES = {  # chunks that fill their window, a spare whose cache holds fewer window frames
    "all": (StreamConfig(scale_frames=3, window=6, attention="sdpa"), 14, 3, 30),
    "flow": (StreamConfig(scale_frames=3, window=6, attention="sdpa", keyframes="flow", flow_threshold=0.8,
                          max_gap=3), 14, 3, 30),
}


@pytest.mark.parametrize("case", sorted(SMALL_SPARE_CASES))
@pytest.mark.slow
def test_a_spare_with_fewer_window_slots_hands_over_what_rollovers_in_place_emit(model, frames, monkeypatch, case):
    """The current engine takes the next chunk over from the spare (a copy of its caches) at the
    switch, so the spare's pool holds pages only for what it takes before then, lent by the current
    engine's storage past its own: the same emissions as rollovers in place, one storage for both
    engines' pages, and the run's cache bytes that storage's once."""
    monkeypatch.setattr(chunked, "MAX_PROVISIONAL_AHEAD", 2)
    monkeypatch.setattr(chunked, "MAX_PROVISIONAL", 2)
    config, chunk_frames, overlap, count = SMALL_SPARE_CASES[case]
    in_place = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=False)
    expected = run_live_marked(in_place, frames[:count])
    engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=True)
    assert engine.spare_window_slots == overlap + 2 + 2 - config.scale_frames < config.window
    try:
        marked = run_live_marked(engine, frames[:count])
        stats = engine.stats()
        current, spare = engine.engine, engine._rollover.spare.engine
        assert current.cache.layout.window_slots is None
        assert spare.cache.layout.allocated_window_slots == engine.spare_window_slots
        assert spare.cache.storage is current.cache.storage and spare.cache.lender is current.cache
        pages, spare_pages = current.cache.bookkeeping.pool, spare.cache.bookkeeping.pool
        assert spare_pages.first_id == pages.end_id and spare_pages.end_id == current.cache.storage.num_pages
        assert spare.cache.bytes_allocated == 0
        assert stats["cache_bytes"] == (current.cache.bytes_allocated + current.camera_cache.bytes_allocated
                                        + spare.camera_cache.bytes_allocated)
    finally:
        engine.close()
    # (chunk 1 then fills the window past the spare's slots on the engine that took it over)
    assert stats["rollovers"] >= 1 and stats["rollovers_ahead"] == stats["rollovers"]
    check_beside_the_stream(marked, expected)


def test_the_provisional_room_shrinks_until_the_spare_fits():
    from stream_recon.models.stream.spare_room import provisional_room_that_fits

    def spare_bytes(room):  # a spare whose cache grows with its room
        return 1000 + 10 * room

    assert provisional_room_that_fits(spare_bytes, 10**6, 48) == 48
    assert provisional_room_that_fits(spare_bytes, 1000 + 10 * 30, 48) == 28  # 48, 44, ... the first that fits
    assert provisional_room_that_fits(spare_bytes, 1000 + 10 * 5, 20) == 4
    assert provisional_room_that_fits(spare_bytes, 1000 + 10 * 3, 20) is None
    assert provisional_room_that_fits(spare_bytes, 1000 + 10 * 3, 2) == 2  # (a room below the smallest step)
    assert provisional_room_that_fits(spare_bytes, 999, 0) is None


def test_a_spare_sized_beside_an_engine_takes_what_is_free_less_the_engine_and_the_margin():
    """The free-memory room (no --gpu-memory), read before the engine is set up: what is free on the device
    less what the engine will take and the margin. The engine's own eager step is in its estimate once: the
    spare's estimate holds one step's activations, and the two engines' eager steps never hold theirs at once
    (the allocator's cache is emptied between them)."""
    from stream_recon.models.stream.memory import WORKSPACE_BYTES
    from stream_recon.models.stream.spare_room import provisional_room_that_fits, room_beside_engine

    mib = 2**20
    free, engine = 14390 * mib, 8000 * mib  # at the scale of a 518x392 engine and spare

    def spare_bytes(room):  # a 518x392 spare: graphs, activations and 38 + room frame slots of 102 MiB
        return 1300 * mib + (38 + room) * 102 * mib

    room = provisional_room_that_fits(spare_bytes, room_beside_engine(free, engine), 20)
    assert room is not None and room < 20
    assert engine + spare_bytes(room) + WORKSPACE_BYTES <= free
    assert engine + spare_bytes(room + 4) + WORKSPACE_BYTES > free  # the next larger room would not fit


def test_an_engine_takes_its_estimate_beside_another_and_the_depth_heads_tables():
    from stream_recon.models.stream.memory import MemoryEstimate
    from stream_recon.models.stream.spare_room import engine_takes

    estimate = MemoryEstimate(weights=1000, head_tables=70, kv_cache=500, camera_cache=3, activations=200,
                              graph_pools=400, attention_copies=0, workspace=90, cuda_context=800)
    assert engine_takes(estimate) == 70 + 500 + 3 + 200 + 400  # the weights are on the device already


def test_under_a_budget_the_spares_room_is_what_the_budget_leaves_beside_the_allocator_or_the_free_memory():
    """--gpu-memory: what is free on the device is capped at what the budget leaves beside the CUDA context
    and the allocator's reserved bytes (budget_left); the engine's bytes and the margin come off either."""
    from stream_recon.models.stream.memory import WORKSPACE_BYTES
    from stream_recon.models.stream.spare_room import room_beside_engine

    mib = 2**20
    free, engine = 15180 * mib, 10000 * mib
    assert room_beside_engine(free, engine, None) == free - engine - WORKSPACE_BYTES
    assert room_beside_engine(free, engine, 14950 * mib) == 4950 * mib - WORKSPACE_BYTES
    assert room_beside_engine(free, engine, 19000 * mib) == room_beside_engine(free, engine)  # the card decides
    assert room_beside_engine(free, engine, 9000 * mib) < 0  # the engine alone fills the budget: no spare


def spare_held_after(model, frames, monkeypatch, chunk_frames: int, taken: int, total: int):
    """Rollovers in place over frames[:total] (run_live_marked's), and an engine with a spare (scale 3,
    window 4, overlap 3) pushed frames[:taken], then its spare held back: (in_place, gate, engine, pushes)."""
    config, overlap = StreamConfig(scale_frames=3, window=4), 3
    reference = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=False)
    in_place = run_live_marked(reference, frames[:total])
    gate = SpareGate(monkeypatch)
    engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=True)
    pushes = [engine.push(frame) for frame in frames[:taken]]
    engine._rollover.spare.wait_until(time.perf_counter() + 60)
    gate.open.clear()
    return in_place, gate, engine, pushes


def check_pushes_beside_the_stream(pushes, in_place) -> None:
    """check_beside_the_stream for a run's emissions, push by push."""
    marked = [[(p.frame_index, p.chunk_index, p.provisional) for p in push] for push in pushes]
    check_beside_the_stream(({p.frame_index: p for push in pushes for p in push}, marked), in_place)


def test_the_closed_window_predicts_new_frames_until_the_spare_has_caught_up(model, frames, monkeypatch):
    """A spare held back at a rollover: the stream goes on, each new frame predicted provisionally by
    the closed window (uncached, aligned as its own frames), until the spare is a frame behind; then
    the engines swap and the new window's emissions, the same as in place, follow."""
    # frames 7, 8, 9 go to the spare as they come
    in_place, gate, engine, pushes = spare_held_after(model, frames, monkeypatch, 10, taken=7, total=16)
    for frame in frames[7:13]:  # window 0 closes at frame 10 (10 frames); the spare holds window 1 from 7
        pushes.append(engine.push(frame))
    assert engine.stats()["provisional_frames"] == 3  # frames 10, 11, 12; the spare not a frame further
    provisional = [p for push in pushes[10:] for p in push if p.provisional]
    assert [(p.frame_index, p.chunk_index) for p in provisional] == [(10, 0), (11, 0), (12, 0)]
    for prediction in provisional:
        assert prediction.frame_type == FRAME_NON_KEY and np.isfinite(prediction.depth).all()
    gate.open.set()
    engine._rollover.spare.wait_until(time.perf_counter() + 60)
    pushes += [engine.push(frame) for frame in frames[13:16]] + [engine.finish()]
    check_pushes_beside_the_stream(pushes, in_place)
    assert engine.stats()["provisional_frames"] == 3  # the spare had caught up at frame 13
    assert engine.stats()["rollovers_ahead"] == engine.stats()["rollovers"] == 1
    engine.close()


def test_a_closed_window_predicts_at_most_its_room_and_the_stream_then_waits(model, frames, monkeypatch):
    # chunks of 8 frames: room for 8 - 3 - 1 provisional frames
    in_place, gate, engine, pushes = spare_held_after(model, frames, monkeypatch, 8, taken=5, total=16)
    pushes += [engine.push(frame) for frame in frames[5:13]]  # window 0 closes at frame 8
    assert engine.stats()["provisional_frames"] == 4  # frames 8-11; frame 12 went to the spare alone
    threading.Timer(0.2, gate.open.set).start()  # the next push waits for the spare
    pushes += [engine.push(frame) for frame in frames[13:16]] + [engine.finish()]
    check_pushes_beside_the_stream(pushes, in_place)
    engine.close()


def test_a_stream_that_ends_while_the_spare_catches_up_ends_its_closed_window_first(model, frames, monkeypatch):
    """The stream ends with the spare held back: the first part of the end (the closed window's
    provisional frames still in flight) comes without waiting for the spare, the rest once it has
    caught up, and all of it is what rollovers in place end with."""
    in_place, gate, engine, pushes = spare_held_after(model, frames, monkeypatch, 10, taken=7, total=12)
    pushes += [engine.push(frame) for frame in frames[7:12]]  # window 0 closes at frame 10
    assert engine._rollover.phase.name == "CATCHING_UP" and engine._rollover.spare.backlog > 1
    parts = engine.finish_in_parts()
    first = next(parts)  # the gate is shut: this returns only if the end does not wait for the spare
    assert engine._rollover.phase.name == "SWITCH_PENDING" and engine._rollover.spare.backlog > 1
    assert all(p.provisional and p.chunk_index == 0 for p in first)
    gate.open.set()
    pushes.append(first + [p for part in parts for p in part])
    check_pushes_beside_the_stream(pushes, in_place)
    assert engine.stats()["rollovers_ahead"] == engine.stats()["rollovers"] == 1
    engine.close()


def test_dropping_what_the_spare_took_does_not_wait_for_it(model, frames, monkeypatch):
    """A moved guess drops the spare's frames while it is still stepping one: the stream's thread does
    not wait; the queued frames are never stepped, and the spare starts afresh before what comes next."""
    gate = SpareGate(monkeypatch)
    engine = ChunkedEngine(model, StreamConfig(scale_frames=3, window=4), chunk_frames=10, overlap=3, lookahead=True)
    for frame in frames[:4]:  # the spare is warmed on these
        engine.push(frame)
    spare = engine._rollover.spare
    spare.wait_until(time.perf_counter() + 60)
    gate.open.clear()
    for frame in frames[4:8]:
        spare.push(frame, 0.0)
    started = time.perf_counter()
    spare.drop()
    assert time.perf_counter() - started < 0.5  # the worker is held at its first frame meanwhile
    gate.open.set()
    for index, frame in enumerate(frames[8:12]):
        spare.push(frame, float(index))
    # a fresh stream: the frame held at the gate was finished and dropped, the other three never ran
    predictions = spare.collect() + spare.engine.finish()
    assert [(p.frame_index, p.timestamp) for p in predictions] == [(i, float(i)) for i in range(4)]
    engine.close()


def test_a_provisional_prediction_of_a_frame_emitted_final_is_never_returned(model, frames):
    """The spare can predict a frame while (or before) the closed chunk predicts it provisionally; what a
    push returns then holds the final emission alone, and no later push returns the frame provisional."""
    engine = ChunkedEngine(model, StreamConfig(scale_frames=2, window=3), chunk_frames=6, overlap=2, lookahead=False)
    predictions = {p.frame_index: p for frame in frames[:5] for p in engine.push(frame)}
    engine.close()
    provisional = {index: dataclasses.replace(p, provisional=True) for index, p in predictions.items()}
    engine.reset()  # a new stream: nothing emitted final yet
    engine._outbox = [provisional[2], predictions[2], provisional[3]]
    assert [(p.frame_index, p.provisional) for p in engine._take_outbox()] == [(2, False), (3, True)]
    engine._outbox = [provisional[1], provisional[2], provisional[4]]
    assert [(p.frame_index, p.provisional) for p in engine._take_outbox()] == [(4, True)]


DENSE_FLOW_CASES = {  # (config, chunk_frames, overlap, frames, DENSE_KEYFRAMES)
    "every_frame_a_keyframe": (StreamConfig(scale_frames=2, window=3, keyframes="flow", flow_threshold=1e9, max_gap=1),
                               8, 3, 26, 0.8),
    "guesses_that_miss": (StreamConfig(scale_frames=3, window=4, keyframes="flow", flow_threshold=0.8, max_gap=3),
                          6, 3, 20, 0.3),
}


@pytest.mark.parametrize("case", sorted(DENSE_FLOW_CASES))
@pytest.mark.slow
def test_a_flow_chunk_of_dense_keyframes_is_taken_ahead_where_it_likely_closes(model, frames, monkeypatch, case):
    """Where most frames are keyframes, the spare takes a flow chunk's likely shared frames before its
    rollover (as for chunks that close at a known frame), and takes them again from a new start when a
    frame that is not a keyframe moves the close: every final emission as rollovers in place make it."""
    config, chunk_frames, overlap, count, dense = DENSE_FLOW_CASES[case]
    monkeypatch.setattr(chunked, "KEYFRAME_RATE_FRAMES", 2)
    monkeypatch.setattr(chunked, "DENSE_KEYFRAMES", dense)
    reference = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=False)
    in_place = run_live_marked(reference, frames[:count])
    engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=True)
    beside = run_live_marked(engine, frames[:count])
    stats = engine.stats()
    engine.close()
    check_beside_the_stream(beside, in_place)
    assert stats["rollovers"] == reference.stats()["rollovers"] >= 2
    # (a start needs the spare done with the chunk before: how many rollovers get one is up to timing)
    assert stats["lookahead_starts"] >= 1
    if case == "every_frame_a_keyframe":  # every guess right: never a second start for one rollover
        assert stats["lookahead_starts"] <= stats["rollovers"] == stats["rollovers_ahead"]


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.slow
def test_each_frame_is_checked_once(model, frames, monkeypatch, lookahead):
    """ChunkedEngine checks a frame once, before anything changes; the engines it goes to take it as
    checked: a rollover in place replays it, a spare takes it, a closed chunk predicts it provisionally.
    An engine checks only its own first frame, whose check sets its caches up."""
    config, chunk_frames, overlap, count = CASES["all"]
    reference = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=False)
    expected = run_live_marked(reference, frames[:count])
    checked: list[StreamingEngine] = []
    check_frame = StreamingEngine.check_frame
    checked_here = []
    checked_frame = chunked.checked_frame

    def counted_check(engine, image):
        checked.append(engine)
        return check_frame(engine, image)

    def counted_here(*args):
        checked_here.append(args[-1])
        return checked_frame(*args)

    monkeypatch.setattr(StreamingEngine, "check_frame", counted_check)
    monkeypatch.setattr(chunked, "checked_frame", counted_here)
    engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=lookahead)
    marked = run_live_marked(engine, frames[:count])
    stats = engine.stats()
    engine.close()
    assert stats["rollovers"] >= 2 and (stats["provisional_frames"] >= 1) == lookahead
    assert checked_here == list(range(count))  # each frame once, by its index in the stream
    assert len(checked) == 1 + lookahead  # the engine's first frame, and the spare's
    assert len({id(checker) for checker in checked}) == 1 + lookahead
    check_beside_the_stream(marked, expected)


def test_a_keyframe_spelling_is_parsed_once_for_every_config_of_a_stream(model, frames):
    """The StreamConfig a ChunkedEngine is given and the copies it makes for its chunks and its spare
    (with their cache size, without the budget): one parse of the spelling between them. The config's
    attributes stay its fields."""
    keyframes._parse_spelling.cache_clear()
    config = StreamConfig(scale_frames=3, window=4, keyframes="Interval:2", gpu_memory=2**40)
    engine = ChunkedEngine(model, config, chunk_frames=6, overlap=2, lookahead=True)
    run_live(engine, frames[:20])
    engine.close()
    assert engine.rollovers_ahead >= 1 and engine.memory_plan is not None
    assert engine.engine.policy == config.policy == IntervalKeyframes(2)
    parses = keyframes._parse_spelling.cache_info()
    assert parses.misses == 1 and parses.hits >= 3
    assert vars(config) == {field.name: getattr(config, field.name) for field in dataclasses.fields(config)}


def test_a_stream_that_ends_during_the_lookahead_leaves_the_next_stream_clean(model, frames):
    config, chunk_frames, overlap, _ = CASES["all"]
    engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=True)
    run_live(engine, frames[:5])  # window 0 is 0-5; the spare took frame 3 and 4 for window 1
    engine.reset()
    second = run_live_marked(engine, frames[:12])
    reference = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=False)
    check_beside_the_stream(second, run_live_marked(reference, frames[:12]))
    engine.close()


@pytest.mark.parametrize("case", ["all", "flow_mixed"])
@pytest.mark.slow
def test_the_spare_delivers_its_last_frame_on_its_worker_before_every_switch(model, frames, monkeypatch, case):
    """The frame the spare takes alone before a switch is followed by a flush on its worker, so the
    switch finds nothing of the spare's in flight (a pipelined spare's last step held a switch 37 ms).
    A stream that ends while the spare catches up switches at its end, where no frame came after."""
    from stream_recon.models.stream import lookahead

    calls = []
    for name in ("push", "flush", "hand_over"):
        def recorded(self, *args, _name=name, _original=getattr(lookahead.SpareEngine, name)):
            calls.append(_name)
            return _original(self, *args)
        monkeypatch.setattr(lookahead.SpareEngine, name, recorded)
    config, chunk_frames, overlap, count = CASES[case]
    engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=True)
    in_place = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=False)
    pushes = [engine.push(frame) for frame in frames[:3 * count]]
    calls_in_the_stream = len(calls)
    pushes.append(engine.finish())
    final = {p.frame_index: p for push in pushes for p in push}
    marked = [[(p.frame_index, p.chunk_index, p.provisional) for p in push] for push in pushes]
    check_beside_the_stream((final, marked), run_live_marked(in_place, frames[:3 * count]))
    switches = [i for i, name in enumerate(calls[:calls_in_the_stream]) if name == "hand_over"]
    assert len(switches) >= 2 and engine.stats()["rollovers_ahead"] - len(switches) <= 1
    for at in switches:
        assert calls[at - 2:at] == ["push", "flush"]  # the last frame, its delivery, the switch
    engine.close()


def test_off_cuda_a_spare_has_no_stream_and_no_partition_is_made(model):
    from stream_recon.models.stream.lookahead import SpareEngine, spare_stream
    from stream_recon.models.stream.sm_partition import partitioned_stream

    assert spare_stream(torch.device("cpu")) is None
    assert partitioned_stream(torch.device("cpu"), 8) is None
    spare = SpareEngine(StreamingEngine(model, StreamConfig(scale_frames=3, window=4)))
    assert not isinstance(spare._stream, torch.cuda.ExternalStream)  # a plain stream where none partitions
    spare.close()


def test_a_spare_hands_over_its_predictions_in_order(model, frames):
    from stream_recon.models.stream.lookahead import SpareEngine

    config = StreamConfig(scale_frames=3, window=4)
    expected = []
    plain = StreamingEngine(model, config)
    for frame in frames[:9]:
        expected += plain.push(frame)
    expected += plain.finish()

    spare = SpareEngine(StreamingEngine(model, config))
    try:
        for index in range(9):
            spare.push(frames[index], float(index))
        spare.wait_until(time.perf_counter() - 1)  # a deadline passed: no wait
        spare.wait_until(time.perf_counter() + 60)
        assert spare.backlog == 0
        taken = spare.take_ready()  # never waits
        while (next_taken := spare.take_next()) is not None:
            taken += next_taken
        taken += spare.collect() + spare.engine.finish()
    finally:
        spare.close()
    assert [p.frame_index for p in taken] == [p.frame_index for p in expected] == list(range(9))
    for ours, theirs in zip(taken, expected, strict=True):
        assert ours.timestamp == theirs.timestamp
        np.testing.assert_array_equal(ours.depth, theirs.depth)


def rollover_invariants_hold(rollover) -> bool:
    """Each phase's invariants (models/stream/rollover.py, Phase's docstring), read off the Rollover."""
    from stream_recon.models.stream.rollover import Phase

    phase = rollover.phase
    if phase is Phase.STEADY:
        return rollover.closed is None and rollover.ahead_from is None and not rollover.ready
    if phase is Phase.AHEAD:
        return rollover.closed is None and rollover.ahead_from is not None
    # CATCHING_UP and SWITCH_PENDING: a closed chunk, nothing taken ahead for another one
    return rollover.closed is not None and rollover.ahead_from is None


PHASE_CASES = {  # chunks long enough that the spare, warmed on the first frames, can work ahead
    "all": (StreamConfig(scale_frames=3, window=4), 10, 3, 16),
    "interval": CASES["interval"],
    "flow_mixed": CASES["flow_mixed"],
}


@pytest.mark.parametrize("case", list(PHASE_CASES))
@pytest.mark.slow
def test_every_push_leaves_the_rollover_in_a_phase_whose_invariants_hold(model, frames, case):
    from stream_recon.models.stream.rollover import Phase

    config, chunk_frames, overlap, count = PHASE_CASES[case]
    engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=True)
    seen = set()
    try:
        for frame in frames[:count]:
            engine.push(frame)
            if engine._rollover is not None:
                assert rollover_invariants_hold(engine._rollover), engine._rollover.phase
                seen.add(engine._rollover.phase)
                assert engine.stats()["rollover_phase"] == engine._rollover.phase.value
        engine.finish()
        assert engine._rollover.phase is Phase.STEADY and rollover_invariants_hold(engine._rollover)
    finally:
        engine.close()
    # keyframes all/interval close at a known frame: the spare works ahead; flow only from the rollover
    assert (Phase.AHEAD in seen) == (case != "flow_mixed")
    assert Phase.SWITCH_PENDING in seen or Phase.CATCHING_UP in seen


def test_a_transition_outside_the_table_is_refused(model):
    from stream_recon.models.stream.chunks import ChunkAlignment
    from stream_recon.models.stream.lookahead import SpareEngine
    from stream_recon.models.stream.rollover import Phase, Rollover

    rollover = Rollover(SpareEngine(StreamingEngine(model, StreamConfig(scale_frames=3, window=4))),
                        ChunkAlignment(overlap=3), provisional_room=2)
    try:
        with pytest.raises(RuntimeError, match="no transition from steady to steady"):
            rollover._enter(Phase.STEADY)
        rollover._enter(Phase.CATCHING_UP)
        with pytest.raises(RuntimeError, match="from catching up to ahead"):
            rollover._enter(Phase.AHEAD)
    finally:
        rollover.close()


def test_the_spare_is_to_be_a_frame_behind_when_the_provisional_room_runs_out():
    from stream_recon.models.stream.rollover import catch_up_backlog

    # a 16 GB card's spare: 16 shared frames to catch up, room for 16 provisional ones
    assert [catch_up_backlog(16, 16, provisional) for provisional in range(17)] == list(range(17, 0, -1))
    assert catch_up_backlog(16, 48, 1) == 16 and catch_up_backlog(16, 48, 48) == 1  # an 80 GB card's room
    assert catch_up_backlog(0, 8, 3) == 1  # a spare that took its frames ahead
    assert catch_up_backlog(4, 0, 0) == 1 and catch_up_backlog(4, 2, 5) == 1  # no room, or past it


class RecordingSpare:
    """What Rollover.pace asks of a spare, recorded."""

    def __init__(self):
        self.calls = []

    def wait_until(self, deadline):
        self.calls.append(("until", deadline))

    def wait_for_backlog(self, at_most, deadline):
        self.calls.append(("backlog", at_most, deadline))


@pytest.mark.parametrize("phase_name", ["CATCHING_UP", "SWITCH_PENDING", "AHEAD"])
def test_catching_up_holds_each_push_until_the_spare_is_on_its_way_or_its_catch_up_pace_has_passed(phase_name):
    import types

    from stream_recon.models.stream.rollover import CATCH_UP_PACE, PACE, Phase, Rollover

    spare = RecordingSpare()
    alignment = types.SimpleNamespace(tail=[], make_ratios=lambda *args, **kwargs: False)
    rollover = Rollover(spare, alignment, provisional_room=16)
    rollover._push_seconds.extend([0.03, 0.02, 0.04])
    rollover.phase, rollover.behind_at_start, rollover.provisional_count = Phase[phase_name], 16, 4
    started = time.perf_counter()
    rollover.pace(started)
    assert spare.calls[0] == ("until", pytest.approx(started + PACE * 0.03))
    if phase_name == "CATCHING_UP":
        assert spare.calls[1:] == [("backlog", 13, pytest.approx(started + CATCH_UP_PACE * 0.03))]
    else:
        assert spare.calls[1:] == []


def test_chunk_links_compose_to_the_chunk_transforms_and_say_how_well_the_overlap_agreed(model, frames):
    from stream_recon.models.stream.similarity import MIN_OVERLAP_SIGMA

    config, chunk_frames, overlap, count = CASES["all"]
    engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap)
    run_live(engine, frames[:count])
    links = engine.chunk_links
    assert [link.index for link in links] == list(range(1, engine.stats()["rollovers"] + 1))
    world_from_chunk = Sim3.identity()
    for link, matrix, scale in zip(links, chunk_transforms(engine)[1:], chunk_scales(engine)[1:], strict=True):
        world_from_chunk = world_from_chunk @ link.previous_from_next
        np.testing.assert_allclose(world_from_chunk.rotation, matrix[:3, :3], atol=1e-9)
        np.testing.assert_allclose(world_from_chunk.translation, matrix[:3, 3], atol=1e-9)
        assert world_from_chunk.scale == pytest.approx(scale, rel=1e-12)
        assert link.num_shared == overlap and link.sigmas.shape == (7,)
        assert np.all(np.isfinite(link.sigmas)) and np.all(link.sigmas > 0)
        assert np.all(link.sigmas[[0, 1, 2, 6]] >= MIN_OVERLAP_SIGMA)  # rotation and log scale: the floors at least


@pytest.mark.parametrize("seed", range(3))
def test_overlap_covariance_measures_the_disagreement_of_the_shared_frames(seed):
    """With the true transform each shared frame's residual is its own disagreement, not the difference of
    two frames' as after an alignment on one anchor frame: the declared variance is half its mean square.
    (tests/test_models_edge_uncertainty.py checks the declared sigmas against the alignment's actual error.)"""
    from stream_recon.models.stream.similarity import MIN_OVERLAP_SIGMA, overlap_covariance

    def overlap_sigmas(target, source, transform):
        return np.sqrt(np.diag(overlap_covariance(target, source, transform, anchor=0)))

    rng = np.random.default_rng(seed)
    truth = random_sim3(rng)
    source_rotations = random_rotations(rng, 67)  # uniform, near identity and near a half turn: 201
    count = len(source_rotations)
    source = np.zeros((count, 9))
    source[:, :3] = rng.normal(0, 1, (count, 3))
    source[:, 3:7] = np.stack([rotation_to_quat_xyzw(r) for r in source_rotations])
    target = truth.apply_to_pose_enc(source)
    exact = overlap_sigmas(target, source, truth)
    np.testing.assert_allclose(exact[:3], MIN_OVERLAP_SIGMA)  # agreement: the floors
    noise_rad, noise_units = 0.01, 0.05
    noisy = target.copy()
    noisy[:, :3] += rng.normal(0, noise_units * truth.scale, (count, 3))  # in target units
    for k in range(count):
        axis_angle = rng.normal(0, noise_rad, 3)
        angle = np.linalg.norm(axis_angle)
        quaternion = np.concatenate([np.sin(angle / 2) * axis_angle / angle, [np.cos(angle / 2)]])
        noisy[k, 3:7] = quat_product_xyzw(noisy[k, 3:7], quaternion)  # R_target @ R(noise)
    sigmas = overlap_sigmas(noisy, source, truth)
    np.testing.assert_allclose(sigmas[:3], noise_rad / np.sqrt(2), rtol=0.25)
    assert np.all(sigmas[3:6] > 0.75 * noise_units / np.sqrt(2))  # the centres' own, plus the anchor's lever arm


def quat_product_xyzw(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    from stream_recon.models.stream.pose import quat_xyzw_product

    return quat_xyzw_product(first, second)


WARM_UP_CASES = ("all", "interval", "flow_mixed", "flow_gap")


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("case", WARM_UP_CASES)
@pytest.mark.slow
def test_a_warm_up_on_copies_of_the_first_frame_changes_no_emission(model, frames, case, lookahead):
    """A warm-up before the first frame (the streaming step run on copies of it, then forgotten; with a
    spare, the spare started and warmed too) leaves every emission of the stream as it is without one,
    bit for bit, rollovers and flow decisions included: in the same pushes (with a spare, whose
    predictions come back as its worker finishes them: the same final emissions in the same order)."""
    config, chunk_frames, overlap, count = CASES[case]
    count = min(len(frames), 3 * count)
    runs = {}
    for warm in (False, True):
        engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=lookahead)
        try:
            if warm:
                seconds = engine.warm_up(frames[0])
                assert seconds["streaming_steps_s"] > 0 and ("spare_s" in seconds) == lookahead
                assert engine.stats()["lookahead"] == lookahead and engine.stats()["frames"] == 0
            runs[warm] = (run_live_marked(engine, frames[:count]), engine.stats())
        finally:
            engine.close()
    ((final, pushes), stats), ((final_cold, pushes_cold), stats_cold) = runs[True], runs[False]
    if lookahead:
        assert [e for push in pushes for e in push if not e[2]] == [e for push in pushes_cold for e in push if not e[2]]
    else:
        assert pushes == pushes_cold
    assert stats["rollovers"] == stats_cold["rollovers"] >= 2
    assert stats["keyframes"] == stats_cold["keyframes"]
    for index, ours in final.items():
        theirs = final_cold[index]
        assert (ours.chunk_index, ours.frame_type) == (theirs.chunk_index, theirs.frame_type)
        for key in ("pose_enc", "c2w", "intrinsics", "depth", "depth_conf"):
            np.testing.assert_array_equal(getattr(ours, key), getattr(theirs, key))
        np.testing.assert_equal(ours.flow_magnitude, theirs.flow_magnitude)


def test_an_engine_with_one_window_slot_warms_up_and_streams_as_a_fresh_one(model, frames):
    """A spare's cache may hold a single window slot (its provisional room shrunk to fit): the warm-up's
    streaming steps take none, so it warms up, and then streams what an engine without a warm-up does."""
    config = StreamConfig(scale_frames=3, window=4, attention="sdpa")
    warm, cold = (StreamingEngine(model, config, window_slots=1) for _ in range(2))
    warm.warm_up(frames[0])
    for frame in frames[:4]:
        for ours, theirs in zip(warm.push(frame), cold.push(frame), strict=True):
            np.testing.assert_array_equal(ours.depth, theirs.depth)
            np.testing.assert_array_equal(ours.pose_enc, theirs.pose_enc)
    assert warm.num_keyframes == cold.num_keyframes == 4


def test_a_warm_up_comes_before_the_first_frame_only(model, frames):
    engine = ChunkedEngine(model, StreamConfig(scale_frames=3, window=4), chunk_frames=6, overlap=3, lookahead=False)
    engine.push(frames[0])
    with pytest.raises(ValueError, match="before its stream's first frame"):
        engine.warm_up(frames[1])
    plain = StreamingEngine(model, StreamConfig(scale_frames=3, window=4))
    plain.push(frames[0])
    with pytest.raises(ValueError, match="before its stream's first frame"):
        plain.warm_up(frames[1])


def test_out_of_memory_in_the_scale_step_beside_a_spare_drops_the_spare_and_streams_as_without(model, frames,
                                                                                               monkeypatch, caplog):
    """A spare started by the warm-up can leave the stream's scale step (its one eager step) out of
    device memory: the spare goes and the step runs again, and the stream emits what a run without a
    spare emits."""
    config, chunk_frames, overlap = StreamConfig(scale_frames=3, window=4), 8, 3
    expected = run_live_marked(ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap,
                                             lookahead=False), frames[:16])
    engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=True)
    engine.warm_up(frames[0])
    assert engine._rollover is not None  # the warm-up started the spare
    runner, calls = engine.engine.runner, []
    run_scale_frames = runner.run_scale_frames

    def out_of_memory_once(*args):
        calls.append(len(args))
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")
        return run_scale_frames(*args)

    monkeypatch.setattr(runner, "run_scale_frames", out_of_memory_once)
    with caplog.at_level("WARNING", logger="stream_recon.models.stream.chunked"):
        final, pushes = run_live_marked(engine, frames[:16])
    engine.close()
    assert len(calls) >= 2 and engine._rollover is None and engine.lookahead is False  # (one scale step a chunk)
    assert "spare goes" in caplog.text
    assert pushes == expected[1] and final.keys() == expected[0].keys()
    for index, prediction in final.items():
        np.testing.assert_array_equal(prediction.depth, expected[0][index].depth)
        np.testing.assert_array_equal(prediction.pose_enc, expected[0][index].pose_enc)


def test_out_of_memory_in_the_spares_warm_up_drops_the_spare_and_streams_as_without(model, frames, monkeypatch,
                                                                                    caplog):
    """A spare whose own warm-up runs out of device memory goes before the stream's first frame; the run
    streams what a run without a spare streams, and asks for no spare again."""
    from stream_recon.models.stream import lookahead

    config, chunk_frames, overlap = StreamConfig(scale_frames=3, window=4), 8, 3
    expected = run_live_marked(ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap,
                                             lookahead=False), frames[:16])
    warmed = []

    def out_of_memory(spare, image):
        warmed.append(spare)
        raise torch.OutOfMemoryError("CUDA out of memory. (a stand-in)")

    monkeypatch.setattr(lookahead.SpareEngine, "_warm", out_of_memory)
    engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=overlap, lookahead=True)
    with caplog.at_level("WARNING", logger="stream_recon.models.stream.chunked"):
        engine.warm_up(frames[0])
    assert len(warmed) == 1 and engine._rollover is None and engine.lookahead is False
    assert "warming up the next chunk's spare" in caplog.text
    final, pushes = run_live_marked(engine, frames[:16])
    engine.close()
    assert len(warmed) == 1 and engine.rollovers_ahead == 0
    assert pushes == expected[1] and final.keys() == expected[0].keys()
    for index, prediction in final.items():
        np.testing.assert_array_equal(prediction.depth, expected[0][index].depth)
        np.testing.assert_array_equal(prediction.pose_enc, expected[0][index].pose_enc)


def test_a_scale_step_that_fails_takes_no_frame(model, frames, monkeypatch):
    """The buffered frames stay buffered and the cache as it was: the next push runs the step again."""
    engine = StreamingEngine(model, StreamConfig(scale_frames=3, window=4))
    reference = StreamingEngine(model, StreamConfig(scale_frames=3, window=4))
    assert engine.push(frames[0]) == [] and engine.push(frames[1]) == []  # (the first frame sets the runner up)
    run_scale_frames, calls = engine.runner.run_scale_frames, []

    def fail_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a stand-in failure")
        return run_scale_frames(*args)

    monkeypatch.setattr(engine.runner, "run_scale_frames", fail_once)
    with pytest.raises(RuntimeError, match="stand-in"):
        engine.push(frames[2])
    assert engine.num_frames == 0 and len(engine._buffer) == 2
    emitted = engine.push(frames[2]) + engine.push(frames[3]) + engine.finish()
    expected = [p for frame in frames[:4] for p in reference.push(frame)] + reference.finish()
    assert [p.frame_index for p in emitted] == [p.frame_index for p in expected] == [0, 1, 2, 3]
    for ours, theirs in zip(emitted, expected, strict=True):
        np.testing.assert_array_equal(ours.depth, theirs.depth)


def test_the_spare_steps_as_its_owner_chose_once_idle(model, frames):
    """`steps_eagerly` on a chunked stream: its engine at once, the spare told when it is next idle (its owner
    remembers what each was told instead of asking the engines at every push), and told again after a switch."""
    engine = ChunkedEngine(model, StreamConfig(scale_frames=2, window=4), chunk_frames=8, overlap=3, lookahead=True)
    try:
        engine.steps_eagerly(True)
        engine.warm_up(frames[0])
        spare = engine._rollover.spare
        assert engine.eager_steps and engine.engine.eager_steps and spare.eager_steps and spare.engine.eager_steps
        engine.steps_eagerly(False)
        assert not engine.engine.eager_steps
        for frame in frames[:12]:
            engine.push(frame)
            spare.wait_until(time.perf_counter() + 30)
        assert engine.stats()["rollovers"] >= 1
        assert not engine.eager_steps and not spare.eager_steps and not spare.engine.eager_steps
        assert not engine.engine.eager_steps
    finally:
        engine.close()


@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("keyframes", ["all", "flow"])
def test_a_frames_walk_through_a_rollover_enters_the_engine_at_most_twice(model, frames, lookahead, keyframes):
    """The frame that closes a chunk, followed on the stream's thread: calls into models/stream/engine.py from
    outside it. In place: the rollover's one call (`start_over`); beside a spare: the closed chunk's `finish`
    and its provisional step. A flow chunk's last keyframe decision was made at the end of the push before
    (StreamConfig.closes_at_cached_frames), so that judging it full calls nothing."""
    config = StreamConfig(scale_frames=2, window=4, keyframes=keyframes, flow_threshold=1e9, max_gap=2)
    engine = ChunkedEngine(model, config, chunk_frames=8, overlap=3, lookahead=lookahead)
    walks = []
    try:
        for frame in frames:
            entries = []

            def note(call, event, arg, entries=entries):
                caller = call.f_back
                if (event == "call" and call.f_code.co_filename.endswith("models/stream/engine.py")
                        and caller is not None and not caller.f_code.co_filename.endswith("models/stream/engine.py")):
                    entries.append(call.f_code.co_name)

            rollovers = engine.rollovers
            sys.setprofile(note)
            try:
                engine.push(frame)
            finally:
                sys.setprofile(None)
            if engine.rollovers > rollovers:
                walks.append(entries)
    finally:
        engine.close()
    assert len(walks) >= 2, walks
    expected = (["finish", "push_checked"] if lookahead else ["start_over"])
    assert all(walk == expected for walk in walks), walks
