"""The LingBot-Map (GCT) streaming model, its configuration, checkpoint IO and streaming engine."""

from .checkpoint import load_model
from .config import ModelConfig
from .engine import KeyframePolicy, StreamConfig, StreamingEngine
from .errors import CheckpointError, FrameError
from .gct import GCTStream
from .prediction import FRAME_KEY, FRAME_NON_KEY, FRAME_SCALE, FramePrediction
from .prepare import InferenceSpec, prepare_for_inference
from .windowed import WindowedEngine

__all__ = [
    "CheckpointError",
    "FRAME_KEY",
    "FRAME_NON_KEY",
    "FRAME_SCALE",
    "FramePrediction",
    "FrameError",
    "GCTStream",
    "InferenceSpec",
    "KeyframePolicy",
    "ModelConfig",
    "StreamConfig",
    "StreamingEngine",
    "WindowedEngine",
    "load_model",
    "prepare_for_inference",
]
