"""The precision a step runs in, eager or recorded: exact float32, or autocast to bf16/fp16."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def float32_exact():
    """A float32 CUDA step in float32: no autocast, and no TF32 in matrix products or cuDNN's
    convolutions (PyTorch lets cuDNN use TF32 by default, which put the patch embedding 7.8e-3 sigma
    off the reference's float32 depth). Scoped to the step, so that bf16 runs in the same process
    keep their settings."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.autocast("cuda", enabled=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def step_precision(device_type: str, autocast_dtype: torch.dtype | None):
    """The precision context of one step: exact float32 (autocast_dtype None; float32_exact on CUDA), or
    autocast to bf16/fp16 without its weight-cast cache: the transformer's weights are in that dtype
    already, compiled blocks then see one autocast state and compile once, and a cast cached during a
    graph capture would be freed after it."""
    if autocast_dtype is None:
        return float32_exact() if device_type == "cuda" else torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=autocast_dtype, cache_enabled=False)
