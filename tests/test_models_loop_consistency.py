"""Loops judged before the pose graph solves with them (models/loops/consistency.py): the batched Sim(3)
algebra against GTSAM, the chain's covariances in O(1) a pair against composition link by link, the two
cycle tests, loops of one chunk pair combined, and what pairwise consistency (PCM) turns away on real
trajectories."""

from __future__ import annotations

import gtsam
import numpy as np
import pytest
from evo_data import evo_data_dir
from loop_scenarios import TRAJECTORIES, make_scenario

from stream_recon.models.loops import sim3_batch as lie
from stream_recon.models.loops.consistency import (
    ChainCovariances,
    chi_square_quantile,
    combine,
    combine_groups,
    compose,
    invert,
    odometry_between,
    odometry_cycle_chi2,
    pair_cycle_chi2,
    pairs_cycle_chi2,
)
from stream_recon.models.loops.gtsam_sim3 import from_gtsam, to_gtsam
from stream_recon.models.loops.pose_graph import optimize
from stream_recon.models.loops.pose_graph_data import PoseGraphSettings
from stream_recon.models.stream.similarity import Sim3


def random_matrix(rng: np.random.Generator, translation: float = 3.0) -> np.ndarray:
    rotation = np.asarray(gtsam.Rot3.Expmap(rng.normal(0, 1, 3)).matrix())
    return Sim3(float(np.exp(rng.normal(0, 0.5))), rotation, rng.normal(0, translation, 3)).scaled_matrix


def random_covariance(rng: np.random.Generator, size: float = 1e-2) -> np.ndarray:
    factor = rng.normal(0, size, (7, 7))
    return factor @ factor.T + 1e-3 * size**2 * np.eye(7)


def gtsam_of(matrix: np.ndarray) -> gtsam.Similarity3:
    return to_gtsam(Sim3.from_matrix(matrix))


def test_the_chi_square_quantile_is_the_tables() -> None:
    assert chi_square_quantile(0.99, 7) == pytest.approx(18.4753, abs=1e-3)
    assert chi_square_quantile(0.95, 2) == pytest.approx(5.9915, abs=1e-3)
    assert chi_square_quantile(0.999, 7) == pytest.approx(24.3219, abs=1e-3)


def test_the_batched_algebra_is_gtsams() -> None:
    rng = np.random.default_rng(0)
    stack = np.stack([random_matrix(rng) for _ in range(20)])
    stack[0] = Sim3(1.0 + 1e-12, np.eye(3), np.array([1.0, 2.0, 3.0])).scaled_matrix  # the series' branch
    for matrix, adjoint, tangent in zip(stack, lie.adjoint(stack), lie.logmap(stack), strict=True):
        np.testing.assert_allclose(adjoint, gtsam_of(matrix).AdjointMap(), atol=1e-12)
        np.testing.assert_allclose(tangent, gtsam.Similarity3.Logmap(gtsam_of(matrix)), atol=1e-10)
    tangents = rng.normal(0, 0.7, (20, 7))
    for tangent, matrix in zip(tangents, lie.expmap(tangents), strict=True):
        np.testing.assert_allclose(matrix, from_gtsam(gtsam.Similarity3.Expmap(tangent)).scaled_matrix, atol=1e-12)
    np.testing.assert_allclose(lie.inverse(stack) @ stack, np.broadcast_to(np.eye(4), stack.shape), atol=1e-10)


@pytest.mark.slow
def test_a_products_covariance_is_the_spread_of_perturbed_products() -> None:
    rng = np.random.default_rng(0)
    factors = [(random_matrix(rng), np.diag(rng.uniform(1e-4, 4e-4, 7))) for _ in range(3)]
    factors.append(invert(factors[0]))
    product, covariance = compose(factors)
    errors = []
    for _ in range(3000):
        moved = np.eye(4)
        for transform, transform_covariance in factors:
            moved = moved @ transform @ lie.expmap(rng.multivariate_normal(np.zeros(7), transform_covariance))
        errors.append(lie.logmap(lie.inverse(product) @ moved))
    spread = np.sqrt(np.diag(np.cov(np.array(errors).T)))
    np.testing.assert_allclose(spread, np.sqrt(np.diag(covariance)), rtol=0.1)


def drifting_chain(rng: np.random.Generator, chunks: int, path: float = 250.0) -> ChainCovariances:
    """Links of `path` units (turning ~20 degrees, scales of their own) with covariances of the
    real-trajectory odometry (~1 degree, 2 %, 1 % of the path): the chain walks thousands of units away."""
    links = []
    for _ in range(chunks - 1):
        turn = np.asarray(gtsam.Rot3.Expmap(rng.normal(0, 0.2, 3)).matrix())
        links.append(Sim3(float(np.exp(rng.uniform(-0.3, 0.3))), turn, np.array([path, 0.0, 0.0])).scaled_matrix)
    sigmas = np.concatenate([np.full(3, 0.01), np.full(3, 0.01 * path), [0.02]])
    covariances = [np.diag(sigmas**2) + random_covariance(rng, 1e-3) for _ in links]
    return ChainCovariances(np.stack(links), np.stack(covariances))


def by_composition(chain: ChainCovariances, x: int, z: int) -> tuple[np.ndarray, np.ndarray]:
    """x_from_z link by link (odometry[k] is k_from_k+1), as the pose graph's reference."""
    if x > z:
        return invert(by_composition(chain, z, x))
    return compose(list(zip(chain.links[x:z], chain.link_covariances[x:z], strict=True)))


def test_the_odometry_between_any_two_chunks_is_the_links_composed() -> None:
    """Anchored sums (O(1) a pair once a chunk's are made) equal the composition link by link to 1e-9, on a
    chain that walks ~10^4 units from its origin; the world-frame sums of the bending test to 1e-6."""
    rng = np.random.default_rng(1)
    chain = drifting_chain(rng, 120)
    assert np.linalg.norm(chain.world_from_chunk[-1][:3, 3]) > 3000
    for x, z in [(0, 119), (5, 6), (100, 110), (110, 100), (60, 3), (119, 118), (7, 7)]:
        transform, covariance = odometry_between(chain, x, z)
        reference_transform, reference_covariance = by_composition(chain, x, z)
        np.testing.assert_allclose(transform, reference_transform, rtol=1e-9, atol=1e-9 * np.abs(transform).max())
        scale = max(np.abs(reference_covariance).max(), 1e-300)
        np.testing.assert_allclose(covariance, reference_covariance, rtol=0, atol=1e-9 * scale)
        if x < z:  # the world-frame sums: the bending test's covariance
            solved = transform @ lie.expmap(np.full(7, 1e-3))
            error = lie.logmap(lie.inverse(transform) @ solved)
            expected = error @ np.linalg.solve(reference_covariance, error)
            assert chain.bending_chi2(np.array([x]), np.array([z]), solved[None])[0] == pytest.approx(expected, rel=1e-6)


def test_block_anchored_sums_equal_the_loops_own_anchored_sums() -> None:
    """A whole run's checks take chain covariances from one anchored sum every 32 chunks: the same rows as
    each chunk's own sum, to 1e-9, on either side of the anchor and across blocks."""
    rng = np.random.default_rng(2)
    chain = drifting_chain(rng, 120)
    x = np.array([0, 5, 31, 32, 33, 63, 64, 100, 119, 119, 40, 40, 70])
    z = np.array([119, 6, 33, 31, 0, 64, 63, 110, 0, 118, 40, 39, 71])
    got = chain.between_covariance(x, z)
    for n, (a, b) in enumerate(zip(x, z, strict=True)):
        expected = chain.anchored(int(a))[int(b)]
        np.testing.assert_allclose(got[n], expected, rtol=0, atol=1e-9 * max(np.abs(expected).max(), 1e-300))


def reference_pair_chi2(chain: ChainCovariances, first: tuple, second: tuple) -> float:
    """The cycle a_from_b @ b_from_d @ (c_from_d)^-1 @ c_from_a composed factor by factor."""
    (measured, covariance, a, b), (other, other_covariance, c, d) = first, second
    cycle, cycle_covariance = compose([(measured, covariance), by_composition(chain, b, d),
                                       invert((other, other_covariance)), by_composition(chain, c, a)])
    error = lie.logmap(cycle)
    return float(error @ np.linalg.solve(cycle_covariance, error))


def test_a_pairs_cycle_in_one_batch_is_the_cycle_composed_factor_by_factor() -> None:
    rng = np.random.default_rng(2)
    chain = drifting_chain(rng, 40, path=5.0)
    ends = [(3, 30), (10, 2), (25, 26), (3, 30), (0, 39)]  # a loop either way round, a repeated pair
    loops = []
    for a, b in ends:
        drift = lie.expmap(rng.normal(0, 0.05, 7))
        loops.append((chain.between(a, b) @ drift, random_covariance(rng, 1e-2), a, b))
    measured = np.stack([loop[0] for loop in loops])
    covariances = np.stack([loop[1] for loop in loops])
    firsts, seconds = np.array([a for a, _ in ends]), np.array([b for _, b in ends])
    for i, loop in enumerate(loops):
        batch = pair_cycle_chi2(chain, (loop[0], loop[1]), (loop[2], loop[3]), (measured, covariances),
                                (firsts, seconds))
        for j, other in enumerate(loops):
            if j != i:
                reference = reference_pair_chi2(chain, loop, other)
                assert batch[j] == pytest.approx(reference, rel=1e-9)
                # the other loop first: the same cycle, linearised elsewhere (second-order terms, ~2 % here)
                assert batch[j] == pytest.approx(reference_pair_chi2(chain, other, loop), rel=0.1)
    single = odometry_cycle_chi2(chain, firsts, seconds, measured, covariances)
    for n, (transform, covariance, a, b) in enumerate(loops):
        cycle, cycle_covariance = compose([(transform, covariance), by_composition(chain, b, a)])
        error = lie.logmap(cycle)
        assert single[n] == pytest.approx(error @ np.linalg.solve(cycle_covariance, error), rel=1e-9)


def test_loops_of_one_chunk_pair_combine_into_their_information_weighted_mean() -> None:
    rng = np.random.default_rng(3)
    centre = random_matrix(rng)
    covariances = np.stack([random_covariance(rng, 1e-2) for _ in range(4)])
    offsets = np.stack([rng.multivariate_normal(np.zeros(7), c) for c in covariances])
    measured = centre[None] @ lie.expmap(offsets)
    mean, covariance = combine(measured, covariances)
    information = np.linalg.inv(covariances)
    np.testing.assert_allclose(covariance, np.linalg.inv(information.sum(axis=0)), rtol=1e-9)
    # the mean is where the weighted errors balance: sum_i Lambda_i Log(mean^-1 Z_i) = 0
    errors = lie.logmap(lie.inverse(mean)[None] @ measured)
    balance = np.einsum("nij,nj->i", information, errors)
    assert np.abs(balance).max() < 1e-8 * np.abs(np.einsum("nij,nj->i", information, offsets)).max()
    # to first order, the linear information-weighted mean of the offsets (offsets of ~1e-2: a few % apart)
    linear = np.linalg.solve(information.sum(axis=0), np.einsum("nij,nj->i", information, offsets))
    np.testing.assert_allclose(lie.logmap(lie.inverse(centre) @ mean), linear, atol=0.05 * np.abs(linear).max())
    one, one_covariance = combine(measured[:1], covariances[:1])
    np.testing.assert_allclose(one, measured[0], atol=1e-12)
    np.testing.assert_allclose(one_covariance, covariances[0], rtol=1e-9)


def test_several_chunk_pairs_combined_in_one_batch_equal_each_pair_combined_alone() -> None:
    rng = np.random.default_rng(6)
    sizes = [3, 1, 5, 2]
    group = np.repeat(np.arange(len(sizes)), sizes)
    centres = [random_matrix(rng) for _ in sizes]
    covariances = np.stack([random_covariance(rng, 1e-2) for _ in group])
    measured = np.stack([centres[g] @ lie.expmap(rng.normal(0, 0.05, 7)) for g in group])
    means, mean_covariances = combine_groups(measured, covariances, group)
    for g in range(len(sizes)):
        alone, alone_covariance = combine(measured[group == g], covariances[group == g])
        np.testing.assert_allclose(means[g], alone, rtol=1e-12, atol=1e-12 * np.abs(alone).max())
        np.testing.assert_allclose(mean_covariances[g], alone_covariance, rtol=1e-12)


# -- pairwise consistency on real trajectories -------------------------------------------------------
SCENARIOS = ("KITTI 00", "TUM fr1_xyz")


def subtle_scenario(name: str, seed: int):
    trajectory = TRAJECTORIES[name]
    return make_scenario(trajectory.poses(evo_data_dir()), seed, revisit_radius=trajectory.revisit_radius,
                         false_min_distance=0.0, scene_depth=trajectory.scene_depth,
                         subtle_false=trajectory.subtle_shift)


@pytest.mark.parametrize("name", SCENARIOS)
@pytest.mark.slow
def test_the_consistent_set_turns_away_subtle_false_loops_and_keeps_the_true_ones(name: str) -> None:
    """PCM alone (no check against the odometry), at its default bound: over 5 seeds it drops most subtle
    false loops and hardly any true loop."""
    settings = PoseGraphSettings(odometry_check=False)
    false_dropped = false_total = true_dropped = true_total = 0
    for seed in range(5):
        scenario = subtle_scenario(name, seed)
        kept = {verdict.loop_id for verdict in optimize(scenario.graph, settings).loops if verdict.consistent}
        false_dropped += len(scenario.false_loops - kept)
        true_dropped += len(scenario.true_loops - kept)
        false_total += len(scenario.false_loops)
        true_total += len(scenario.true_loops)
    assert false_dropped >= 0.6 * false_total, (false_dropped, false_total)
    assert true_dropped <= 0.03 * true_total, (true_dropped, true_total)


def test_pairs_of_different_loops_in_one_batch_equal_each_loops_own_batch() -> None:
    """A solve's new loops judged in one call (each pair anchored at its own loop's chunks) give what one
    call per loop gives, to the last bits' rounding."""
    rng = np.random.default_rng(4)
    chain = drifting_chain(rng, 50, path=5.0)
    ends = np.array([(3, 30), (10, 2), (25, 26), (40, 7), (0, 49), (12, 44)])
    measured = np.stack([chain.between(a, b) @ lie.expmap(rng.normal(0, 0.05, 7)) for a, b in ends])
    covariances = np.stack([random_covariance(rng, 1e-2) for _ in ends])
    pairs = np.array([(i, j) for i in range(len(ends)) for j in range(len(ends)) if i != j])
    loop, other = pairs[:, 0], pairs[:, 1]
    batch = pairs_cycle_chi2(chain, (measured[loop], covariances[loop]), (ends[loop, 0], ends[loop, 1]),
                             (measured[other], covariances[other]), (ends[other, 0], ends[other, 1]))
    for n, (i, j) in enumerate(pairs):
        alone = pair_cycle_chi2(chain, (measured[i], covariances[i]), tuple(ends[i]), (measured[[j]], covariances[[j]]),
                                (ends[[j], 0], ends[[j], 1]))
        assert batch[n] == pytest.approx(alone[0], rel=1e-10)


def test_the_written_out_determinant_equals_lapacks() -> None:
    matrices = np.random.default_rng(5).normal(size=(200, 3, 3)) + 2 * np.eye(3)
    np.testing.assert_allclose(lie.determinant3(matrices), np.linalg.det(matrices), rtol=1e-12, atol=1e-12)
