"""What a prepared model says of itself: the device and precision it was made ready for, and how its
parts compile. Set once by models/builds/prepare.py; read by whatever runs the model (the engine, the
caches' compiled helpers), which never converts a model it was handed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from stream_recon.cache.backends import HALF_DTYPES


@dataclass(frozen=True)
class InferenceSpec:
    """How a model was prepared (`model.inference_spec`)."""

    device: torch.device
    dtype: torch.dtype  # the transformer's (and DPT head's) precision; the camera head is float32
    compiled: bool  # blocks and heads fused by torch.compile
    half_camera_weights: bool  # the camera head's large layers read float16 weights
    # How helpers of a compiled model compile (a function in, its compiled version out); None uncompiled.
    compile_function: Callable | None = None

    @property
    def half_precision(self) -> bool:
        return self.dtype in HALF_DTYPES


def require_prepared(model: torch.nn.Module, device: torch.device | None = None,
                     dtype: torch.dtype | None = None) -> InferenceSpec:
    """The model's InferenceSpec; a clear error for an unprepared model or one prepared for another
    device or precision than the caller asks for."""
    spec = getattr(model, "inference_spec", None)
    if spec is None:
        raise ValueError("the engine takes a prepared model: call stream_recon.models.prepare_for_inference("
                         "model, device, dtype) once after loading it")
    if dtype is not None and dtype != spec.dtype:
        raise ValueError(f"the model was prepared for {dtype_name(spec.dtype)}, not {dtype_name(dtype)}; prepare the "
                         f"loaded model again with dtype={dtype_name(dtype)}")
    if device is not None and torch.device(device) != spec.device and not _same_device(torch.device(device), spec.device):
        raise ValueError(f"the model was prepared for {spec.device}, not {device}; prepare the loaded model for it")
    return spec


def _same_device(a: torch.device, b: torch.device) -> bool:
    """cuda and cuda:0 name the same device when the current device is 0."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
