"""Edge uncertainty from the fits themselves: each edge's declared covariance against its actual error.

Loop edges (closer.loop_edge): two emitted keyframes see the same points, each through the depth model
that the covariance states (per point: 0.5% depth error along the ray and 0.2% of the depth across it,
about a pixel at a 500 px focal length; per keyframe: its whole depth map scaled by ~2% and its
orientation off by ~1e-3 rad), in two chunks that the open chain placed with drift. Odometry edges
(similarity.overlap_covariance): two chunks' predictions of their shared frames, each frame's pose off by
the per-frame noise and its depth by a per-frame scale, aligned as the engine aligns them. Over many seeds,
the RMS of each tangent component's actual error in units of its declared sigma is near 1.
"""

from __future__ import annotations

import gtsam
import numpy as np
import pytest
from helpers import random_sim3

from stream_recon.models.loops.closer import LoopClosureConfig, _KeyframePoints, align_loop, loop_edge
from stream_recon.models.loops.gtsam_sim3 import to_gtsam
from stream_recon.models.stream.similarity import Sim3, fit_covariance, scaling_direction, tangent_jacobian

SEEDS = 300
RATIO_RANGE = (0.5, 2.0)  # RMS of error / sigma, per component
COMPONENTS = ("rot x", "rot y", "rot z", "trans x", "trans y", "trans z", "log scale")


def rotation(rng: np.random.Generator, sigma: float) -> np.ndarray:
    return np.asarray(gtsam.Rot3.Expmap(rng.normal(0, sigma, 3)).matrix())


def tangent_error(truth: Sim3, measured: Sim3) -> np.ndarray:
    """e with measured = truth @ Exp(e): the pose graph's error of the edge, up to its sign."""
    return np.asarray(gtsam.Similarity3.Logmap(to_gtsam(truth.inverse() @ measured)))


def normalised_rms(errors: list[np.ndarray], sigmas: list[np.ndarray]) -> np.ndarray:
    """[7] RMS over the seeds of each component's error in units of its declared sigma."""
    return np.sqrt(np.mean((np.array(errors) / np.array(sigmas)) ** 2, axis=0))


def assert_honest(ratios: np.ndarray) -> None:
    low, high = RATIO_RANGE
    bad = {name: round(float(r), 2) for name, r in zip(COMPONENTS, ratios, strict=True) if not low <= r <= high}
    assert not bad, f"error / declared sigma outside {RATIO_RANGE}: {bad} (all: {np.round(ratios, 2).tolist()})"


# -- the pieces ------------------------------------------------------------------------------------
def test_the_tangent_jacobian_is_the_derivative_of_exp_at_zero() -> None:
    rng = np.random.default_rng(0)
    points = rng.normal(0, 3, (5, 3))
    step = 1e-6
    for k in range(7):
        tangent = np.zeros(7)
        tangent[k] = step
        moved = np.array([gtsam.Similarity3.Expmap(tangent).transformFrom(p) for p in points])
        np.testing.assert_allclose((moved - points) / step, tangent_jacobian(points)[:, :, k], atol=1e-4)


def test_a_scaling_direction_scales_about_its_centre() -> None:
    centre = np.array([1.0, -2.0, 3.0])
    grow = gtsam.Similarity3.Expmap(0.01 * scaling_direction(centre))
    np.testing.assert_allclose(grow.transformFrom(centre), centre, atol=1e-6)


def test_the_fit_covariance_matches_the_spread_of_repeated_fits() -> None:
    """Independent isotropic noise: the Gauss-Newton covariance of one fit against the scatter of many."""
    from stream_recon.models.stream.similarity import umeyama

    rng = np.random.default_rng(1)
    truth, points, noise = random_sim3(rng), rng.normal(0, 1, (40, 3)) + [0, 0, 4], 0.01
    target = truth.apply_to_points(points)
    errors, sigmas = [], []
    for _ in range(SEEDS):
        noisy = target + rng.normal(0, noise, target.shape)
        fit = umeyama(points, noisy)
        errors.append(tangent_error(truth, fit))
        sigmas.append(np.sqrt(np.diag(fit_covariance(points, noisy - fit.apply_to_points(points), fit.scale))))
    assert_honest(normalised_rms(errors, sigmas))


# -- loop edges ------------------------------------------------------------------------------------
POINT_DEPTH_NOISE = 0.005  # of a point's depth, along its ray
POINT_LATERAL_NOISE = 0.002  # of a point's depth, across its ray: about a pixel at a 500 px focal length


def observed(rng: np.random.Generator, points: np.ndarray, centre: np.ndarray, depth_scale_sigma: float,
             rotation_sigma: float, point_noise: float) -> np.ndarray:
    """What a keyframe at `centre` puts at `points`: per-point depth and ray errors, then its whole view
    scaled and turned about its camera."""
    offsets = points - centre
    distance = np.linalg.norm(offsets, axis=1, keepdims=True)
    ray = offsets / distance
    lateral = rng.normal(0, point_noise * POINT_LATERAL_NOISE, points.shape) * distance
    lateral -= np.sum(lateral * ray, axis=1, keepdims=True) * ray
    noisy = offsets * (1 + rng.normal(0, point_noise * POINT_DEPTH_NOISE, (len(points), 1))) + lateral
    return centre + np.exp(rng.normal(0, depth_scale_sigma)) * noisy @ rotation(rng, rotation_sigma).T


def loop_trial(rng: np.random.Generator, config: LoopClosureConfig, point_noise: float,
               count: int = 80) -> tuple[np.ndarray, np.ndarray]:
    """One loop: chunk 1 revisits chunk 0's place; the open chain placed chunk 1 with drift; the keyframes
    err as `config` declares per keyframe, and by `point_noise` times the per-point model. -> (the edge's
    actual error, its declared sigmas)."""
    true_edge = random_sim3(rng)  # chunk 1 -> chunk 0
    drift = Sim3(float(np.exp(rng.normal(0, 0.1))), rotation(rng, 0.1), rng.normal(0, 1, 3))
    chain = [random_sim3(rng)]
    chain.append(chain[0] @ true_edge @ drift)  # the open chain's placement of chunk 1
    query_to_earlier = chain[0] @ true_edge @ chain[1].inverse()  # between the emitted worlds
    earlier_centre, facing = rng.normal(0, 5, 3), rotation(rng, 1.0)
    rays = np.stack([rng.uniform(-0.6, 0.6, count), rng.uniform(-0.4, 0.4, count), np.ones(count)], axis=1)
    points = earlier_centre + (rays * rng.uniform(2, 5, (count, 1))) @ facing.T
    query_centre = query_to_earlier.inverse().apply_to_points(earlier_centre + rng.normal(0, 0.3, 3))
    scale_sigma, rotation_sigma = config.keyframe_depth_scale_sigma, config.keyframe_rotation_sigma
    earlier = _KeyframePoints(observed(rng, points, earlier_centre, scale_sigma, rotation_sigma, point_noise),
                              float(np.median(np.linalg.norm(points - earlier_centre, axis=1))), earlier_centre)
    query = _KeyframePoints(observed(rng, query_to_earlier.inverse().apply_to_points(points), query_centre,
                                     scale_sigma, rotation_sigma, point_noise), 1.0, query_centre)
    alignment = align_loop(query, earlier, np.stack([np.arange(count)] * 2, axis=1), config)
    assert alignment.passed
    edge = loop_edge("loop", 0, 1, alignment, chain, config)
    return tangent_error(true_edge, edge.first_from_second), edge.sigmas


OFF = 1e-12  # a per-keyframe sigma that is as good as none (sigmas must be positive)
LOOP_CASES = {  # name: (config, point noise as a multiple of the per-point model)
    "the depth model": (LoopClosureConfig(), 1.0),
    # Each part alone, the others (nearly) absent both in the simulation and in the declared covariance: a
    # part left out of loop_covariance then shows as a ratio far above 2.
    "points only": (LoopClosureConfig(keyframe_depth_scale_sigma=OFF, keyframe_rotation_sigma=OFF), 1.0),
    "keyframe depth scales only": (LoopClosureConfig(keyframe_rotation_sigma=OFF), 0.01),
    "keyframe orientations only": (LoopClosureConfig(keyframe_depth_scale_sigma=OFF), 0.01),
}


@pytest.mark.parametrize("case", LOOP_CASES)
@pytest.mark.slow
def test_a_loop_edge_declares_the_error_it_has(case: str) -> None:
    config, point_noise = LOOP_CASES[case]
    rng = np.random.default_rng(2)
    errors, sigmas = zip(*(loop_trial(rng, config, point_noise) for _ in range(SEEDS)), strict=True)
    assert_honest(normalised_rms(list(errors), list(sigmas)))


def test_a_loop_edge_is_expressed_at_the_second_chunks_origin() -> None:
    """The same fit placed farther from chunk `second`'s origin: its translation sigma grows with the lever
    arm of the rotation and scale errors, its rotation and log-scale sigmas stay."""
    rng = np.random.default_rng(3)
    config = LoopClosureConfig()
    count = 40
    points = rng.normal(0, 1, (count, 3)) + [0, 0, 4]
    earlier = _KeyframePoints(points + rng.normal(0, 0.01, points.shape), 4.0, np.zeros(3))
    query = _KeyframePoints(points, 4.0, np.zeros(3))
    alignment = align_loop(query, earlier, np.stack([np.arange(count)] * 2, axis=1), config)
    near = loop_edge("near", 0, 1, alignment, [Sim3.identity(), Sim3.identity()], config)
    far_placement = Sim3(1.0, np.eye(3), np.array([100.0, 0.0, 0.0]))  # chunk 1's origin 100 units away
    far = loop_edge("far", 0, 1, alignment, [Sim3.identity(), far_placement], config)
    np.testing.assert_allclose(far.sigmas[[0, 1, 2, 6]], near.sigmas[[0, 1, 2, 6]], rtol=1e-6)
    assert np.all(far.sigmas[4:6] > 10 * near.sigmas[4:6])  # y, z: rotation and scale errors times 100 units


def test_an_edge_with_a_covariance_costs_its_mahalanobis_distance() -> None:
    """measured = a_from_b @ Exp(e) with a full covariance C costs e^T C^-1 e, not the diagonal's |e / sigmas|^2."""
    from stream_recon.models.loops import pose_graph
    from stream_recon.models.loops.gtsam_sim3 import from_gtsam
    from stream_recon.models.loops.pose_graph_data import LoopEdge

    rng = np.random.default_rng(4)
    world_from_chunk = (Sim3.identity(), random_sim3(rng))
    factor = rng.normal(0, 0.01, (7, 7))
    covariance = factor @ factor.T + 1e-6 * np.eye(7)
    error = rng.multivariate_normal(np.zeros(7), covariance)
    measured = world_from_chunk[1] @ from_gtsam(gtsam.Similarity3.Expmap(error))
    edge = LoopEdge("loop", 0, 1, measured, np.sqrt(np.diag(covariance)), covariance=covariance)
    chi2 = pose_graph.loop_chi2([edge], world_from_chunk)[0]
    assert chi2 == pytest.approx(error @ np.linalg.solve(covariance, error), rel=1e-6)
    diagonal = float(np.sum((error / edge.sigmas) ** 2))
    assert abs(chi2 - diagonal) > 1e-3 * chi2  # the correlations count



# -- odometry edges --------------------------------------------------------------------------------
SHARED_FRAMES = 16  # the engine's overlap
FRAME_ROTATION_NOISE = 0.002  # rad per axis: two chunks' predictions of one frame's orientation
FRAME_CENTRE_NOISE = 0.005  # source units per axis: ... and of its camera centre
FRAME_DEPTH_SCALE_NOISE = 0.01  # log: ... and of its whole depth map's scale
PIXEL_DEPTH_NOISE = 0.01  # per pixel, relative


def pose_encodings(rotations: np.ndarray, centres: np.ndarray) -> np.ndarray:
    from stream_recon.models.stream.pose import rotation_to_quat_xyzw

    encodings = np.zeros((len(centres), 9))
    encodings[:, :3] = centres
    encodings[:, 3:7] = np.stack([rotation_to_quat_xyzw(r) for r in rotations])
    encodings[:, 7:] = 1.0  # the field of view: unused by the alignment
    return encodings


def odometry_trial(rng: np.random.Generator, start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One rollover: the source chunk's first SHARED_FRAMES frames from `start` (its coordinates), the
    target chunk's predictions of them through the true Sim(3) with per-frame noise; aligned as the engine
    aligns them. -> (the alignment's actual error, its declared sigmas)."""
    from stream_recon.models.stream.similarity import (
        FrameRatios,
        alignment_frames,
        estimate_chunk_alignment,
        overlap_covariance,
    )

    truth = random_sim3(rng)
    heading = rotation(rng, 1.0)
    centres = start + np.outer(np.arange(SHARED_FRAMES) * 0.05, heading[:, 2])  # walking forward
    rotations = np.stack([heading @ rotation(rng, 0.05) for _ in range(SHARED_FRAMES)])
    target_rotations = np.stack([rotation(rng, FRAME_ROTATION_NOISE) @ truth.rotation @ r for r in rotations])
    target_centres = truth.apply_to_points(centres + rng.normal(0, FRAME_CENTRE_NOISE, centres.shape))
    source_depth = [rng.uniform(1, 5, (24, 32)) for _ in range(SHARED_FRAMES)]
    target_depth = [truth.scale * np.exp(rng.normal(0, FRAME_DEPTH_SCALE_NOISE)) * depth
                    * (1 + rng.normal(0, PIXEL_DEPTH_NOISE, depth.shape)) for depth in source_depth]
    keyframe = np.ones(SHARED_FRAMES, bool)
    ratios = {k: FrameRatios.of(target_depth[k], source_depth[k]) for k in range(SHARED_FRAMES)}
    target, source = pose_encodings(target_rotations, target_centres), pose_encodings(rotations, centres)
    fit = estimate_chunk_alignment(target, target_depth, keyframe, source, source_depth, keyframe, ratios)
    anchor, rows = alignment_frames(keyframe, keyframe)
    covariance = overlap_covariance(target, source, fit, anchor, [ratios[k] for k in rows.tolist()])
    return tangent_error(truth, fit), np.sqrt(np.diag(covariance))


@pytest.mark.parametrize("start", ["at the origin", "far from the origin"])
@pytest.mark.slow
def test_an_odometry_edge_declares_the_error_it_has(start: str) -> None:
    """A chunk's shared frames are its first, near its origin; far from it, the lever arm of the anchor's
    rotation and scale errors dominates the translation."""
    rng = np.random.default_rng(5)
    offset = np.zeros(3) if start == "at the origin" else np.array([20.0, -10.0, 5.0])
    errors, sigmas = zip(*(odometry_trial(rng, offset) for _ in range(SEEDS)), strict=True)
    assert_honest(normalised_rms(list(errors), list(sigmas)))
