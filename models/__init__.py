"""The LingBot-Map (GCT) streaming model, its configuration, checkpoint IO and streaming engine.

The names below are imported on first use: a light module of this package (stream_config, the
checkpoint names) can then be read without loading torch, as `stream-recon -h` does.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module of this package that defines it
_HOMES = {
    "load_model": "checkpoint",
    "ChunkedEngine": "chunked",
    "ModelConfig": "config",
    "StreamingEngine": "engine",
    "CheckpointError": "errors",
    "FrameError": "errors",
    "MemoryBudgetError": "errors",
    "GCTStream": "gct",
    "MemoryEstimate": "memory",
    "MemoryPlan": "memory",
    "estimate_memory": "memory",
    "plan_memory": "memory",
    "FRAME_KEY": "prediction",
    "FRAME_NON_KEY": "prediction",
    "FRAME_SCALE": "prediction",
    "FramePrediction": "prediction",
    "InferenceSpec": "prepare",
    "prepare_for_inference": "prepare",
    "KeyframePolicy": "stream_config",
    "StreamConfig": "stream_config",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})

