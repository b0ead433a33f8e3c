"""The LingBot-Map (GCT) streaming model, its configuration, checkpoint IO and streaming engine."""

from .checkpoint import load_model
from .config import ModelConfig
from .engine import KeyframePolicy, StreamConfig, StreamingEngine
from .errors import CheckpointError, FrameError
from .gct import GCTStream
from .prediction import FRAME_KEY, FRAME_NON_KEY, FRAME_SCALE, FramePrediction

__all__ = [
    "CheckpointError",
    "FRAME_KEY",
    "FRAME_NON_KEY",
    "FRAME_SCALE",
    "FramePrediction",
    "FrameError",
    "GCTStream",
    "KeyframePolicy",
    "ModelConfig",
    "StreamConfig",
    "StreamingEngine",
    "load_model",
]
