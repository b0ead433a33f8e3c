"""The GPU tests' shared helpers: the golden frames streamed on CUDA, errors against the golden
outputs and between two runs, the bf16 tolerance, and a tiny model for long streams
(tests/test_gpu_flashinfer.py, test_gpu_fast_path.py, test_gpu_fp8.py)."""

from __future__ import annotations

import numpy as np
import torch
from conftest import build_tiny_model
from golden_utils import golden_frames, relative_error

# bf16 against the fp32 golden outputs, as max |o - g| / std(g). The reference's own bf16 path
# differs from its fp32 path by about 0.1 sigma (depth) and 0.25 sigma (pose). Measured on an
# H200 (2026-11-22, docs/performance-log.md): FlashInfer bf16 vs golden 0.088 (depth), 0.100
# (confidence), 0.145 (pose), 0.038 (c2w); FlashInfer vs SDPA, both bf16, at most 0.144 (pose).
BF16_TOLERANCE = {"depth": 0.25, "depth_conf": 0.25, "pose_enc": 0.4, "c2w": 0.15}


SCENARIOS = {
    "all_keyframes": dict(keyframes="all"),
    "interval_2": dict(keyframes="interval:2"),
    "flow": dict(keyframes="flow", flow_threshold=43.0, max_gap=3),
}


def stream(model, dtype, attention, compile=False, artefacts=None, **options):
    """Stream the golden frames on the GPU through a model prepared for `dtype` from the loaded
    (float32, CPU) `model`, which stays as it is."""
    from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference

    prepared = prepare_for_inference(model, "cuda", dtype, compile=compile, artefacts=artefacts)
    engine = StreamingEngine(prepared, StreamConfig(scale_frames=3, window=4, attention=attention, **options))
    predictions = []
    for frame in golden_frames():
        predictions += engine.push(frame.cuda())
    predictions += engine.finish()  # pipelined streaming hands the last frame over here
    return predictions, engine


def errors(predictions, golden) -> dict[str, float]:
    out = {"pose_enc": float(relative_error(np.stack([p.pose_enc for p in predictions]), golden["pose_enc"], axis=0).max())}
    for key in ("depth", "depth_conf", "c2w"):
        out[key] = float(relative_error(np.stack([getattr(p, key) for p in predictions]), golden[key]))
    return out


def long_stream_tiny_model():
    """The tiny model with room for 2,100 temporal positions, prepared for bf16 on the GPU."""
    from stream_recon.models import ModelConfig, prepare_for_inference

    config = ModelConfig.from_dict({**ModelConfig.tiny().to_dict(), "max_frames": 2100})
    return prepare_for_inference(build_tiny_model(config), "cuda", torch.bfloat16)


KEYS = ("pose_enc", "depth", "depth_conf", "c2w")


def as_golden(predictions) -> dict[str, np.ndarray]:
    """Predictions stacked as a golden outputs.npz holds them, so that `errors` compares two runs."""
    return {k: np.stack([getattr(p, k) for p in predictions]) for k in KEYS}
