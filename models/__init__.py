"""The LingBot-Map (GCT) streaming model, its configuration, checkpoint IO and streaming engine."""

from .checkpoint import load_model
from .chunked import ChunkedEngine
from .config import ModelConfig
from .engine import StreamingEngine
from .errors import CheckpointError, FrameError, MemoryBudgetError
from .gct import GCTStream
from .memory import MemoryEstimate, MemoryPlan, estimate_memory, plan_memory
from .prediction import FRAME_KEY, FRAME_NON_KEY, FRAME_SCALE, FramePrediction
from .prepare import InferenceSpec, prepare_for_inference
from .stream_config import KeyframePolicy, StreamConfig

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
    "MemoryBudgetError",
    "MemoryEstimate",
    "MemoryPlan",
    "ModelConfig",
    "StreamConfig",
    "StreamingEngine",
    "ChunkedEngine",
    "estimate_memory",
    "load_model",
    "plan_memory",
    "prepare_for_inference",
]
