"""Deterministic synthetic weights (fixtures README §1): a tensor's values from its name and shape.

The golden fixtures were produced with these weights, so tests, benchmarks and demos without a
real checkpoint all use them.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

_POSE_FC2_BIAS_OFFSET = np.array([0, 0, 0, 0, 0, 0, 0.25, 0.25, 0.25], dtype=np.float32)


def synthetic_tensor(name: str, shape: tuple[int, ...], out: np.ndarray | None = None) -> np.ndarray:
    """The tensor `name` of `shape`, float32; written into `out` (C-contiguous float32 of that shape) where given,
    every step in place: the same values as a new array, without a second array of the size to fill."""
    x = np.random.default_rng(zlib.crc32(name.encode("utf-8"))).standard_normal(shape, dtype=np.float32, out=out)
    f32 = np.float32
    if name == "camera_head.pose_branch.fc2.weight":
        x *= f32(0.002)
    elif name == "camera_head.pose_branch.fc2.bias":
        # Keeps the untrained camera plausible: positive FoVs and a non-degenerate quaternion.
        x *= f32(0.02)
        x += _POSE_FC2_BIAS_OFFSET
    elif len(shape) >= 2:
        x *= f32(0.02)
    elif name.endswith(".weight"):
        x *= f32(0.05)
        x += f32(1.0)
    elif name.endswith(".gamma"):
        x *= f32(0.02)
        x += f32(0.1)
    else:
        x *= f32(0.02)
    return x


def synthetic_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: torch.from_numpy(synthetic_tensor(name, tuple(tensor.shape)))
        for name, tensor in model.state_dict().items()
    }


def load_synthetic_weights(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every tensor of its state dict set to its synthetic values. A float32 tensor on the host is
    filled where it lies (the full-size model's 1.16 B values: 12 s instead of 22 s on one core, where a state dict
    of new arrays was made and then copied in); any other is copied in as load_state_dict does."""
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if tensor.device.type == "cpu" and tensor.dtype == torch.float32 and tensor.is_contiguous():
                synthetic_tensor(name, tuple(tensor.shape), out=tensor.numpy())
            else:
                tensor.copy_(torch.from_numpy(synthetic_tensor(name, tuple(tensor.shape))))
    return model
