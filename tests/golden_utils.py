"""Shared helpers for the golden-fixture tests (official outputs on deterministic weights)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

GOLDEN = Path(__file__).parent / "golden"
TOLERANCE = 1e-3  # fixtures README §5: max |ours - golden| / std(golden)


def relative_error(ours: np.ndarray, golden: np.ndarray, axis=None) -> np.ndarray:
    """max |o - g| / (std(g) + 1e-12), over all elements (axis None) or per component."""
    ours, golden = np.asarray(ours, dtype=np.float64), np.asarray(golden, dtype=np.float64)
    return np.abs(ours - golden).max(axis=axis) / (golden.std(axis=axis) + 1e-12)


def golden_frames() -> torch.Tensor:
    """The 14 model inputs [14, 3, 126, 224] float32, bit-identical to the official tensor."""
    images = np.load(GOLDEN / "inputs" / "preprocessed.npz")["images_u8"]
    return torch.from_numpy(images.astype(np.float32) / np.float32(255))


def golden_settings(scenario: str) -> dict:
    return json.loads((GOLDEN / scenario / "settings.json").read_text())


@lru_cache(maxsize=1)
def full_size_model():
    """The official architecture with the fixtures' synthetic weights, float32, CPU."""
    from stream_recon.models import GCTStream, ModelConfig
    from stream_recon.models.synthetic import load_synthetic_weights

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GCTStream(ModelConfig())
    model = model.to_empty(device="cpu")
    load_synthetic_weights(model)
    return model.eval()


@lru_cache(maxsize=1)
def prepared_full_size_model():
    """full_size_model() prepared for streaming on the CPU in float32 (it shares the weights)."""
    from stream_recon.models import prepare_for_inference

    return prepare_for_inference(full_size_model(), "cpu", torch.float32)
