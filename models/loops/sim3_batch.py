"""Sim(3) algebra on stacks of transforms, in the pose graph's tangent (GTSAM's Similarity3 order).

A transform is a [4, 4] scaled matrix [sR | t] (x -> s R x + t, models/stream/similarity.Sim3); a stack is
[..., 4, 4]. The tangent is [rotation x, y, z (rad), translation x, y, z (source units), log scale], the
perturbation T @ Exp(e) on the right. `adjoint` and `logmap` equal GTSAM's Similarity3.AdjointMap and
Logmap (tests/test_models_loop_consistency.py checks them against GTSAM); here they run on thousands of
transforms in one NumPy call, where a Python loop of GTSAM objects costs ~10 us a transform.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..stream.similarity import Sim3, _rotation_vectors

TANGENT_DIM = 7
# Below these squared angles / log scales the closed forms of Logmap divide by ~0: their Taylor series
# (GTSAM's thresholds) are exact to float64 there.
_SMALL = 1e-9


def matrices(transforms: Sequence[Sim3]) -> np.ndarray:
    """Sim3 objects -> [N, 4, 4] scaled matrices."""
    out = np.zeros((len(transforms), 4, 4))
    for n, transform in enumerate(transforms):
        out[n] = transform.scaled_matrix
    return out


def to_sim3(matrix: np.ndarray) -> Sim3:
    scale, rotation, translation = parts(matrix)
    return Sim3(float(scale), rotation, translation)


def to_sim3s(stack: np.ndarray) -> tuple[Sim3, ...]:
    """[N, 4, 4] -> N Sim3 objects (their parts split in one call)."""
    scale, rotation, translation = parts(stack)
    return tuple(Sim3(float(scale[n]), rotation[n], translation[n].copy()) for n in range(len(stack)))


def determinant3(m: np.ndarray) -> np.ndarray:
    """[..., 3, 3] -> [...] determinants, written out: NumPy's det factors each 3 x 3 matrix by LAPACK at
    ~0.4 us a matrix, which for a few hundred matrices costs 5x these nine products."""
    return (m[..., 0, 0] * (m[..., 1, 1] * m[..., 2, 2] - m[..., 1, 2] * m[..., 2, 1])
            - m[..., 0, 1] * (m[..., 1, 0] * m[..., 2, 2] - m[..., 1, 2] * m[..., 2, 0])
            + m[..., 0, 2] * (m[..., 1, 0] * m[..., 2, 1] - m[..., 1, 1] * m[..., 2, 0]))


def parts(stack: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[..., 4, 4] -> scale [...], rotation [..., 3, 3], translation [..., 3]."""
    scale = np.cbrt(determinant3(stack[..., :3, :3]))
    return scale, stack[..., :3, :3] / scale[..., None, None], stack[..., :3, 3]


def normalised(stack: np.ndarray) -> np.ndarray:
    """[..., 4, 4] with each rotation projected back onto SO(3) (the nearest, by SVD). An inverse taken as
    R^T doubles a rotation's departure from orthogonality; a stream's solves, each starting from the last,
    would compound it (1e-16 grew to 1e-9 in 60 solves here) without this."""
    scale, rotation, translation = parts(stack)
    left, _, right = np.linalg.svd(rotation)
    out = stack.copy()
    out[..., :3, :3] = scale[..., None, None] * (left @ right)
    return out


def inverse(stack: np.ndarray) -> np.ndarray:
    """[..., 4, 4] -> the inverse transforms: [R^T / s | -R^T t / s]."""
    scale, rotation, translation = parts(stack)
    out = np.zeros_like(stack)
    inverse_block = np.swapaxes(rotation, -1, -2) / scale[..., None, None]
    out[..., :3, :3] = inverse_block
    out[..., :3, 3] = -np.einsum("...ij,...j->...i", inverse_block, translation)
    out[..., 3, 3] = 1.0
    return out


def skew(vectors: np.ndarray) -> np.ndarray:
    """[..., 3] -> [..., 3, 3] cross-product matrices."""
    out = np.zeros(vectors.shape + (3,))
    x, y, z = vectors[..., 0], vectors[..., 1], vectors[..., 2]
    out[..., 0, 1], out[..., 0, 2], out[..., 1, 2] = -z, y, -x
    out[..., 1, 0], out[..., 2, 0], out[..., 2, 1] = z, -y, x
    return out


def adjoint(stack: np.ndarray) -> np.ndarray:
    """[..., 4, 4] -> [..., 7, 7] Ad_T: T @ Exp(e) @ T^-1 = Exp(Ad_T e).

    With x -> s R x + t: [[R, 0, 0], [[t]x R, s R, -t], [0, 0, 1]].
    """
    scale, rotation, translation = parts(stack)
    out = np.zeros(stack.shape[:-2] + (TANGENT_DIM, TANGENT_DIM))
    out[..., :3, :3] = rotation
    out[..., 3:6, :3] = skew(translation) @ rotation
    out[..., 3:6, 3:6] = scale[..., None, None] * rotation
    out[..., 3:6, 6] = -translation
    out[..., 6, 6] = 1.0
    return out


def sandwich(transport: np.ndarray, covariance: np.ndarray) -> np.ndarray:
    """A C A^T over stacks: a covariance carried by the linear map A."""
    return transport @ covariance @ np.swapaxes(transport, -1, -2)


def _translation_jacobian(rotation_vector: np.ndarray, log_scale: np.ndarray) -> np.ndarray:
    """[..., 3, 3] V(w, lambda): Exp([w, u, lambda]) has translation V u (GTSAM's Similarity3::GetV)."""
    theta2 = np.sum(rotation_vector**2, axis=-1)
    big = theta2 > _SMALL
    theta2_safe = np.where(big, theta2, 1.0)
    theta = np.sqrt(theta2_safe)
    sinc = np.sin(theta) / theta
    y = np.where(big, (1.0 - np.cos(theta)) / theta2_safe, 0.5 - theta2 / 24.0)
    z = np.where(big, (1.0 - sinc) / theta2_safe, 1.0 / 6.0 - theta2 / 120.0)
    w = np.where(big, (0.5 - y) / theta2_safe, 1.0 / 24.0 - theta2 / 720.0)
    lam = log_scale
    lam2, lam3 = lam * lam, lam * lam * lam
    scaled = lam2 > _SMALL
    lam_safe, lam2_safe = np.where(scaled, lam, 1.0), np.where(scaled, lam2, 1.0)
    decay = np.exp(-lam)
    a = np.where(scaled, (1.0 - decay) / lam_safe, 1.0 - lam / 2.0 + lam2 / 6.0)
    alpha = np.where(scaled, 1.0 / (1.0 + theta2 / lam2_safe), 0.0)
    beta = np.where(scaled, (decay - 1.0 + lam) / lam2_safe, 0.5 - lam / 6.0 + lam2 / 24.0 - lam3 / 120.0)
    mu = np.where(scaled, (1.0 - lam + 0.5 * lam2 - decay) / (lam2_safe * lam_safe),
                  1.0 / 6.0 - lam / 24.0 + lam2 / 120.0 - lam3 / 720.0)
    gamma, upsilon = y - lam * z, z - lam * w
    b = alpha * (beta - gamma) + gamma
    c = alpha * (mu - upsilon) + upsilon
    cross = skew(rotation_vector)
    return (a[..., None, None] * np.eye(3) + b[..., None, None] * cross + c[..., None, None] * cross @ cross)


def expmap(tangent: np.ndarray) -> np.ndarray:
    """[..., 7] -> [..., 4, 4] Exp(e) (GTSAM's Similarity3.Expmap)."""
    rotation_vector, u, log_scale = tangent[..., :3], tangent[..., 3:6], tangent[..., 6]
    angle = np.linalg.norm(rotation_vector, axis=-1)
    small = angle < 1e-8
    safe = np.where(small, 1.0, angle)
    cross = skew(rotation_vector)
    first = np.where(small, 1.0, np.sin(safe) / safe)[..., None, None]
    second = np.where(small, 0.5, (1.0 - np.cos(safe)) / safe**2)[..., None, None]
    rotation = np.eye(3) + first * cross + second * cross @ cross
    scale = np.exp(log_scale)
    out = np.zeros(tangent.shape[:-1] + (4, 4))
    out[..., :3, :3] = scale[..., None, None] * rotation
    # GTSAM's translation V u is ours over the scale
    out[..., :3, 3] = scale[..., None] * np.einsum("...ij,...j->...i", _translation_jacobian(rotation_vector,
                                                                                             log_scale), u)
    out[..., 3, 3] = 1.0
    return out


def logmap(stack: np.ndarray) -> np.ndarray:
    """[..., 4, 4] -> [..., 7] tangent vectors e with Exp(e) = T (GTSAM's Similarity3.Logmap)."""
    scale, rotation, translation = parts(stack)
    rotation_vector = _rotation_vectors(rotation)
    log_scale = np.log(scale)
    jacobian = _translation_jacobian(rotation_vector, log_scale)
    # GTSAM's translation is ours over the scale (its x -> s (R x + t))
    u = np.linalg.solve(jacobian, (translation / scale[..., None])[..., None])[..., 0]
    return np.concatenate([rotation_vector, u, log_scale[..., None]], axis=-1)


def mahalanobis2(error: np.ndarray, covariance: np.ndarray) -> np.ndarray:
    """[..., 7], [..., 7, 7] -> [...] e^T C^-1 e."""
    return np.einsum("...i,...i->...", error, np.linalg.solve(covariance, error[..., None])[..., 0])


def residual_chi2(measured: np.ndarray, solved: np.ndarray, covariance: np.ndarray) -> np.ndarray:
    """[...] an edge's squared residual in its covariance: Log(measured^-1 @ solved), measured [..., 4, 4] and
    its covariance [..., 7, 7] on the right, solved [..., 4, 4] what the poses make of it."""
    return mahalanobis2(logmap(inverse(measured) @ solved), covariance)


__all__ = ["adjoint", "expmap", "inverse", "logmap", "mahalanobis2", "matrices", "normalised", "parts", "residual_chi2",
           "sandwich", "skew", "to_sim3", "to_sim3s"]
