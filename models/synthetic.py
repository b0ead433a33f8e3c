"""Deterministic synthetic weights (fixtures README §1): a tensor's values from its name and shape.

The golden fixtures were produced with these weights, so tests, benchmarks and demos without a
real checkpoint all use them.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

_POSE_FC2_BIAS_OFFSET = np.array([0, 0, 0, 0, 0, 0, 0.25, 0.25, 0.25], dtype=np.float32)


def synthetic_tensor(name: str, shape: tuple[int, ...]) -> np.ndarray:
    x = np.random.default_rng(zlib.crc32(name.encode("utf-8"))).standard_normal(shape, dtype=np.float32)
    f32 = np.float32
    if name == "camera_head.pose_branch.fc2.weight":
        return f32(0.002) * x
    if name == "camera_head.pose_branch.fc2.bias":
        # Keeps the untrained camera plausible: positive FoVs and a non-degenerate quaternion.
        return f32(0.02) * x + _POSE_FC2_BIAS_OFFSET
    if len(shape) >= 2:
        return f32(0.02) * x
    if name.endswith(".weight"):
        return f32(1.0) + f32(0.05) * x
    if name.endswith(".gamma"):
        return f32(0.1) + f32(0.02) * x
    return f32(0.02) * x


def synthetic_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: torch.from_numpy(synthetic_tensor(name, tuple(tensor.shape)))
        for name, tensor in model.state_dict().items()
    }


def load_synthetic_weights(model: torch.nn.Module) -> torch.nn.Module:
    model.load_state_dict(synthetic_state_dict(model), strict=True)
    return model
