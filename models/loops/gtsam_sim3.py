"""Our Sim(3) as GTSAM's Similarity3 and back, one transform or a whole graph's poses at once, and a between
factor of a measured edge.

Its own module because it is the one place the two conventions meet: GTSAM's Similarity3(R, t, s) maps
x -> s (R x + t), where our Sim3 maps x -> s R x + t, so each conversion divides or multiplies the
translation by the scale.
"""

from __future__ import annotations

import gtsam
import numpy as np

from ..stream.similarity import Sim3
from . import sim3_batch as lie


def to_gtsam(transform: Sim3) -> gtsam.Similarity3:
    """Our x -> s R x + t as GTSAM's x -> s (R x + t'), so t' = t / s."""
    return gtsam.Similarity3(gtsam.Rot3(transform.rotation), transform.translation / transform.scale,
                             transform.scale)


def from_gtsam(transform: gtsam.Similarity3) -> Sim3:
    scale = float(transform.scale())
    return Sim3(scale, np.asarray(transform.rotation().matrix(), np.float64),
                scale * np.asarray(transform.translation(), np.float64))


def between_factor(first: int, second: int, measured: np.ndarray, covariance: np.ndarray) -> gtsam.NonlinearFactor:
    return gtsam.BetweenFactorSimilarity3(first, second, to_gtsam(lie.to_sim3(measured)),
                                          gtsam.noiseModel.Gaussian.Covariance(np.array(covariance)))


def gtsam_poses(world_from_chunk: np.ndarray) -> list[gtsam.Similarity3]:
    # GTSAM's Similarity3 matrix is [R | t / s] over [0 | 1 / s]: ours, [sR | t] over [0 | 1], divided by s
    # (one constructor call a chunk; building it from parts costs 3x as much)
    scale = lie.parts(world_from_chunk)[0]
    return [gtsam.Similarity3(theirs) for theirs in world_from_chunk / scale[:, None, None]]


def gtsam_values(world_from_chunk: np.ndarray) -> gtsam.Values:
    values = gtsam.Values()
    for k, pose in enumerate(gtsam_poses(world_from_chunk)):
        values.insert(k, pose)
    return values


def matrices_of(values: gtsam.Values, count: int) -> np.ndarray:
    theirs = np.stack([values.atSimilarity3(k).matrix() for k in range(count)])  # [R | t/s] over [0 | 1/s]
    out = theirs / theirs[:, 3:, 3:]
    out[:, 3, :3] = 0.0
    out[:, 3, 3] = 1.0
    return out


__all__ = ["between_factor", "from_gtsam", "gtsam_poses", "gtsam_values", "matrices_of", "to_gtsam"]
