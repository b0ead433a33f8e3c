"""Loop detection: the descriptors, the keyframe index, the geometric check, and the weight-free path
run frame by frame over real pictures (tests/data/loop: the official `loop` scene, 1 frame in 3).

Chunks are 60 frames of the original scene, i.e. 20 fixture frames: a keyframe may close a loop only
with keyframes two or more chunks back. Which views overlap comes from the fixture's COLMAP
reconstruction (tests/data/loop/README.md): two views overlap when they observe at least
MIN_SHARED_POINTS common triangulated points; a view COLMAP did not register overlaps nothing.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_recon.models.loops.detection import LoopDetector
from stream_recon.models.loops.geometric_check import (
    ESSENTIAL,
    FUNDAMENTAL,
    NOT_FITTED,
    GeometricCheckConfig,
    ImageFeatures,
    check_pair,
    extract_features,
    match_features,
)
from stream_recon.models.loops.retrieval import (
    KeyframeIndex,
    RetrievalConfig,
    gradient_grid_descriptor,
)
from stream_recon.models.network.descriptor import gem_descriptor

FIXTURE = Path(__file__).parent / "data" / "loop"
CHUNK_FRAMES = 60  # original frames per chunk = 20 fixture frames
MIN_SHARED_POINTS = 10  # the overlap rule of the fixture's README
FIRST_FRAMES = range(0, 16)  # the walk's start: fixture frames 0 ... 15
LAST_FRAMES = range(228, 237)  # its return: fixture frames 228, 231, 234


# -- the fixture ---------------------------------------------------------------------------------------
def fixture_frames() -> list[int]:
    return sorted(int(path.stem) for path in FIXTURE.glob("*.jpg"))


@cache
def load_rgb(frame: int) -> np.ndarray:
    return cv2.cvtColor(cv2.imread(str(FIXTURE / f"{frame:06d}.jpg")), cv2.COLOR_BGR2RGB)


@cache
def reference() -> dict:
    return json.loads((FIXTURE / "reference_covisibility.json").read_text())


def overlaps(frame_a: int, frame_b: int) -> bool:
    a, b = sorted((frame_a, frame_b))
    return any(x == a and y == b and n >= MIN_SHARED_POINTS for x, y, n in reference()["shared_points"])


def reference_intrinsics() -> np.ndarray:
    focal, cx, cy, _ = reference()["camera"]["params"]  # SIMPLE_RADIAL: f, cx, cy, k
    return np.array([[focal, 0, cx], [0, focal, cy], [0, 0, 1]], np.float64)


def test_fixture_holds_the_return_to_the_start():
    frames = fixture_frames()
    assert frames == list(range(0, 237, 3))
    assert load_rgb(0).shape == (294, 518, 3)
    registered = set(reference()["registered_frames"])
    assert {0, 3, 6, 9, 12, 228, 231, 234} <= registered
    assert overlaps(234, 12) and overlaps(231, 9)  # the loop the detector has to find
    assert not overlaps(60, 180)  # two corridors walked in opposite directions


@cache
def weight_free_inputs(frame: int) -> tuple[np.ndarray, ImageFeatures]:
    """A fixture frame's gradient-grid descriptor and SIFT features (~60 ms), computed once."""
    return gradient_grid_descriptor(load_rgb(frame)), extract_features(load_rgb(frame))


def features(frame: int) -> ImageFeatures:
    return weight_free_inputs(frame)[1]


# -- GeM ------------------------------------------------------------------------------------------------
def test_gem_descriptor_shapes_and_norm():
    tokens = torch.randn(3, 50, 16, generator=torch.Generator().manual_seed(0))
    batch = gem_descriptor(tokens)
    assert batch.shape == (3, 16) and batch.dtype == torch.float32
    torch.testing.assert_close(batch.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(gem_descriptor(tokens[1]), batch[1])  # [P, C] -> [C], frames not pooled together


def test_gem_pools_magnitudes_over_patches():
    tokens = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    reference_descriptor = gem_descriptor(tokens)
    torch.testing.assert_close(gem_descriptor(tokens[torch.randperm(40)]), reference_descriptor)  # order-free
    torch.testing.assert_close(gem_descriptor(-tokens), reference_descriptor)  # sign-free: |tokens|
    mean_magnitude = tokens.abs().mean(0)
    torch.testing.assert_close(gem_descriptor(tokens, p=1.0), mean_magnitude / mean_magnitude.norm())
    # p -> inf is max pooling: at p = 256 each channel is within (1/40)^(1/256) = 98.6% of its maximum
    max_magnitude = tokens.abs().amax(0)
    assert torch.allclose(gem_descriptor(tokens, p=256.0), max_magnitude / max_magnitude.norm(), atol=0.03)
    torch.testing.assert_close(gem_descriptor(tokens * 1e20), reference_descriptor)  # no float32 overflow
    # p = 3 sits between: a channel with one strong patch outweighs its mean more than p = 1 does
    spiky = torch.full((40, 2), 0.1)
    spiky[0, 0] = 4.0
    assert gem_descriptor(spiky)[0] > gem_descriptor(spiky, p=1.0)[0]


def test_gem_rejects_tokens_without_patches():
    with pytest.raises(ValueError):
        gem_descriptor(torch.zeros(0, 8))
    with pytest.raises(ValueError):
        gem_descriptor(torch.zeros(8))


def test_gem_of_the_models_patch_tokens(tiny_model):
    """What the engine has at hand: the embedding's tokens, special tokens first."""
    image = torch.from_numpy(cv2.resize(load_rgb(0), (252, 140))).permute(2, 0, 1)[None].float() / 255
    with torch.no_grad():
        tokens = tiny_model.aggregator.embed(image, torch.zeros(1, dtype=torch.long), 1)  # [1, P, C]
    descriptor = gem_descriptor(tokens[:, tiny_model.config.num_special_tokens:])
    assert descriptor.shape == (1, tiny_model.config.embed_dim)
    assert torch.isfinite(descriptor).all()
    torch.testing.assert_close(descriptor.norm(), torch.tensor(1.0))


# -- the weight-free descriptor -------------------------------------------------------------------------
def test_gradient_grid_descriptor_is_a_centred_unit_vector():
    descriptor = gradient_grid_descriptor(load_rgb(0))
    assert descriptor.shape == (128,) and descriptor.dtype == np.float32
    assert np.linalg.norm(descriptor) == pytest.approx(1.0, abs=1e-5)
    assert descriptor.mean() == pytest.approx(0.0, abs=1e-6)
    grey = cv2.cvtColor(load_rgb(0), cv2.COLOR_RGB2GRAY)
    np.testing.assert_allclose(gradient_grid_descriptor(grey), descriptor, atol=1e-6)


def test_gradient_grid_descriptor_ignores_exposure_and_flat_frames():
    image = load_rgb(0)
    darker = (image * 0.6).astype(np.uint8)  # a gain change scales every gradient alike
    assert float(gradient_grid_descriptor(darker) @ gradient_grid_descriptor(image)) > 0.99
    assert not gradient_grid_descriptor(np.full((294, 518, 3), 128, np.uint8)).any()


def test_gradient_grid_descriptor_tells_places_apart():
    def similarity(a, b):
        return float(weight_free_inputs(a)[0] @ weight_free_inputs(b)[0])

    assert similarity(0, 3) > 0.8  # the next keyframe, a step down the corridor
    assert similarity(234, 12) > similarity(234, 120) + 0.2  # the return vs the far end of the walk
    assert similarity(231, 9) > similarity(231, 180)


# -- the index ------------------------------------------------------------------------------------------
def add_all(index: KeyframeIndex, descriptors: np.ndarray, frames: list[int], chunks: list[int]) -> None:
    for descriptor, frame, chunk in zip(descriptors, frames, chunks, strict=True):
        index.add(descriptor, frame, chunk)


@st.composite
def indexed_streams(draw):
    """Keyframes in stream order (increasing frames, non-decreasing chunks), a query and a config."""
    count = draw(st.integers(0, 40))
    gaps = draw(st.lists(st.integers(1, 6), min_size=count, max_size=count))
    frames = list(np.cumsum(gaps).tolist())
    steps = draw(st.lists(st.integers(0, 1), min_size=count, max_size=count))
    chunks = list(np.cumsum(steps).tolist())
    small_ints = st.integers(-3, 3)
    descriptors = np.array(draw(st.lists(st.lists(small_ints, min_size=4, max_size=4), min_size=count,
                                         max_size=count)), np.float32).reshape(count, 4)
    query = np.array(draw(st.lists(small_ints, min_size=4, max_size=4)), np.float32)
    query_chunk = draw(st.integers(0, (chunks[-1] if chunks else 0) + 2))
    config = RetrievalConfig(top_k=draw(st.integers(1, 5)), min_similarity=draw(st.floats(-1.0, 0.9)),
                             suppression_frames=draw(st.integers(0, 8)), excluded_chunks=draw(st.integers(1, 3)))
    return frames, chunks, descriptors, query, query_chunk, config


@settings(max_examples=200, deadline=None, derandomize=True)
@given(indexed_streams())
@pytest.mark.slow
def test_candidates_obey_exclusion_threshold_order_and_suppression(stream):
    frames, chunks, descriptors, query, query_chunk, config = stream
    index = KeyframeIndex(4, initial_capacity=1)
    add_all(index, descriptors, frames, chunks)
    found = index.candidates(query, query_chunk, config)
    similarity = dict(zip(frames, index.similarities(query).tolist(), strict=True))
    chunk_of = dict(zip(frames, chunks, strict=True))
    assert len(found) <= config.top_k
    for candidate in found:
        assert candidate.chunk_index == chunk_of[candidate.frame_index]
        assert candidate.chunk_index <= query_chunk - config.excluded_chunks  # outside the recent chunks
        assert candidate.similarity >= config.min_similarity
        assert candidate.similarity == pytest.approx(similarity[candidate.frame_index])
    scores = [c.similarity for c in found]
    assert scores == sorted(scores, reverse=True)
    kept = [c.frame_index for c in found]
    assert all(abs(a - b) > config.suppression_frames for i, a in enumerate(kept) for b in kept[i + 1:])
    # Nothing eligible was dropped for no reason: the list is full, or a kept candidate at least as
    # similar lies within the suppression radius.
    if len(found) < config.top_k:
        for frame in frames:
            eligible = (chunk_of[frame] <= query_chunk - config.excluded_chunks
                        and similarity[frame] >= config.min_similarity)
            if eligible and frame not in kept:
                assert any(abs(frame - k) <= config.suppression_frames and similarity[k] >= similarity[frame] - 1e-6
                           for k in kept)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.integers(1, 70), st.integers(1, 8))
def test_index_grows_by_doubling_and_keeps_every_keyframe(count, initial_capacity):
    rng = np.random.default_rng(count)
    descriptors = rng.standard_normal((count, 6)).astype(np.float32)
    index = KeyframeIndex(6, initial_capacity=initial_capacity)
    capacities = set()
    for i, descriptor in enumerate(descriptors):
        index.add(descriptor, 3 * i, i // 5)
        capacities.add(index.capacity)
    assert len(index) == count
    assert all(capacity // initial_capacity in {1 << k for k in range(8)} for capacity in capacities)
    assert index.capacity < 2 * max(count, initial_capacity)
    np.testing.assert_array_equal(index.frame_indices, 3 * np.arange(count))
    unit = descriptors / np.linalg.norm(descriptors, axis=1, keepdims=True)
    np.testing.assert_allclose(index.similarities(descriptors[-1]), unit @ unit[-1], atol=1e-5)


def test_index_takes_each_frame_once_in_any_order():
    index = KeyframeIndex(3)
    index.add(np.ones(3), 10, 2)
    with pytest.raises(ValueError):
        index.add(np.ones(3), 10, 2)  # the same frame again
    index.add(np.ones(3), 8, 1)  # an earlier frame of an earlier chunk: a flow chunk's rollover emits so
    with pytest.raises(ValueError):
        index.add(np.ones(4), 11, 2)  # another dimension
    with pytest.raises(ValueError):
        index.add(np.array([1.0, np.nan, 0.0]), 11, 2)
    index.add(torch.ones(3), 11, 2)
    assert len(index) == 3 and list(index.frame_indices) == [10, 8, 11]


def test_index_excludes_the_current_and_previous_chunk():
    index = KeyframeIndex(2)
    for frame, chunk in [(0, 0), (5, 1), (10, 2), (15, 3)]:
        index.add(np.array([1.0, 0.0]), frame, chunk)
    config = RetrievalConfig(top_k=5, min_similarity=0.5, suppression_frames=0)
    assert [c.frame_index for c in index.candidates(np.array([1.0, 0.0]), 3, config)] == [0, 5]
    assert index.candidates(np.array([1.0, 0.0]), 1, config) == []
    assert index.candidates(np.array([0.0, 1.0]), 3, config) == []  # below the threshold
    assert index.candidates(np.zeros(2), 3, config) == []  # a flat frame's descriptor matches nothing


def test_suppression_keeps_the_best_of_neighbouring_frames():
    index = KeyframeIndex(2)
    angles = {0: 0.30, 3: 0.10, 6: 0.20, 30: 0.25, 33: 0.05}  # radians from the query: smaller is better
    for frame, angle in angles.items():
        index.add(np.array([np.cos(angle), np.sin(angle)]), frame, 0)
    config = RetrievalConfig(top_k=5, min_similarity=0.0, suppression_frames=9)
    assert [c.frame_index for c in index.candidates(np.array([1.0, 0.0]), 2, config)] == [33, 3]


# -- the geometric check --------------------------------------------------------------------------------
def test_check_accepts_the_loop_pair_with_either_model():
    query, earlier = features(234), features(12)
    essential = check_pair(query, earlier, reference_intrinsics(), reference_intrinsics())
    fundamental = check_pair(query, earlier)
    assert essential.geometry == ESSENTIAL and fundamental.geometry == FUNDAMENTAL
    for result in (essential, fundamental):
        assert result.passed
        assert result.inliers >= 3 * GeometricCheckConfig().min_inliers
        assert result.inlier_ratio == pytest.approx(result.inliers / result.matches)
    assert check_pair(query, earlier) == fundamental  # seeded RANSAC: the same answer every time


def test_check_rejects_views_that_do_not_overlap():
    # 234 and 54: the same corridor's look (the descriptor ranks 54 second), one shared point in COLMAP
    assert not overlaps(234, 54)
    result = check_pair(features(234), features(54),
                        reference_intrinsics(), reference_intrinsics())
    assert result.geometry == ESSENTIAL and not result.passed  # enough matches to fit, too few agree
    assert result.inliers < GeometricCheckConfig().min_inliers
    opposite = check_pair(features(60), features(180))
    assert not opposite.passed


def test_check_of_an_image_with_itself_and_with_a_blank_one():
    keypoints = features(90)
    itself = check_pair(keypoints, keypoints)
    assert itself.passed and itself.matches >= 0.9 * len(keypoints) and itself.inlier_ratio > 0.95
    blank = extract_features(np.zeros((294, 518, 3), np.uint8))
    assert len(blank) == 0
    result = check_pair(keypoints, blank)
    assert (result.matches, result.inliers, result.geometry, result.passed) == (0, 0, NOT_FITTED, False)


def test_matches_are_mutual_and_pass_the_ratio_test():
    a, b = features(231), features(9)
    matches = match_features(a, b)
    assert len(np.unique(matches[:, 0])) == len(matches) == len(np.unique(matches[:, 1]))
    assert len(match_features(a, b, ratio=0.6)) < len(matches)  # a stricter ratio keeps fewer
    assert a.descriptors.dtype == np.uint8 and a.keypoints.shape == (len(a), 2)


# -- the weight-free path over the stream -----------------------------------------------------------------
def run_stream(intrinsics: np.ndarray | None):
    """Feed the detector the fixture frame by frame, as a stream would: query, check, then add. (Each
    frame's descriptor and features are computed once for the module: a frame's own function.)"""
    detector = LoopDetector(128)
    checked = []
    for frame in fixture_frames():
        descriptor, keypoints = weight_free_inputs(frame)
        checked += detector.add_keyframe(frame, frame // CHUNK_FRAMES, descriptor, keypoints, intrinsics)
    return checked


@pytest.mark.slow  # ~5 s of SIFT over the 79 frames (the first of the two), ~2 s of checks each
@pytest.mark.parametrize("intrinsics", [None, "reference"], ids=["fundamental", "essential"])
def test_weight_free_stream_closes_the_loop_and_accepts_no_false_pair(intrinsics):
    checked = run_stream(None if intrinsics is None else reference_intrinsics())
    accepted = [(c.query_frame, c.candidate.frame_index) for c in checked if c.accepted]
    assert any(q in LAST_FRAMES and c in FIRST_FRAMES for q, c in accepted), accepted
    assert all(overlaps(q, c) for q, c in accepted), [(q, c) for q, c in accepted if not overlaps(q, c)]
    for c in checked:
        assert c.query_chunk - c.candidate.chunk_index >= RetrievalConfig().excluded_chunks
    # the check did reject candidates it could fit a model to, not only those without matches
    assert any(c.check.geometry != NOT_FITTED and not c.accepted for c in checked)


def test_add_image_is_the_weight_free_path():
    detector = LoopDetector(128)
    for frame in (0, 3):
        detector.add_image(frame, 0, load_rgb(frame))
    found = detector.add_image(234, 3, load_rgb(234))
    expected = LoopDetector(128)
    for frame in (0, 3):
        expected.add_keyframe(frame, 0, *weight_free_inputs(frame))
    assert found == expected.add_keyframe(234, 3, *weight_free_inputs(234))
    assert len(detector) == 3
