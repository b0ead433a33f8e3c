"""The LingBot-Map (GCT) streaming model, its configuration, checkpoint IO and streaming engine.

The names below are imported on first use: a light module of this package (stream_config, the
checkpoint names) can then be read without loading torch, as `stream-recon -h` does.
"""

from __future__ import annotations

from stream_recon.cache.lazy_names import lazy_names

# name -> the module of this package that defines it
_HOMES = {
    "load_model": "checkpoint",
    "ChunkedEngine": "stream.chunked",
    "ModelConfig": "network.config",
    "StreamingEngine": "stream.engine",
    "CheckpointError": "errors",
    "CheckpointUnavailable": "errors",
    "FrameError": "errors",
    "MemoryBudgetError": "errors",
    "GCTStream": "network.gct",
    "MemoryEstimate": "stream.memory",
    "MemoryPlan": "stream.memory",
    "estimate_memory": "stream.memory",
    "plan_memory": "stream.memory",
    "parse_memory_size": "stream.memory_size",
    "FRAME_KEY": "stream.prediction",
    "FRAME_NON_KEY": "stream.prediction",
    "FRAME_SCALE": "stream.prediction",
    "FramePrediction": "stream.prediction",
    "InferenceSpec": "network.prepared",
    "prepare_for_inference": "builds.prepare",
    "KeyframePolicy": "stream.keyframe_policy",
    "keyframe_spellings": "stream.keyframes",
    "parse_keyframes": "stream.keyframes",
    "StreamConfig": "stream.stream_config",
    "DEFAULT_CHECKPOINT": "checkpoint_names",
    "KNOWN_CHECKPOINTS": "checkpoint_names",
    "DaemonPool": "daemon_pool",
    "ChildCalls": "child_process",
    "ChildDied": "child_process",
    "keep_freed_memory": "child_process",
    "partitioned_stream": "stream.sm_partition",
    "chunk_stream_config": "stream.chunked",
    "EVEN_ODDS_CONFIDENCE": "stream.prediction",
    "FLOW_THRESHOLD": "stream.keyframes.flow",
    "MAX_GAP": "stream.keyframes.flow",
    "SCALE_FRAMES": "stream.stream_config",
    "TRAINED_VIEWS": "stream.stream_config",
    "WINDOW": "stream.stream_config",
    "MAP_DIR": "loops.saved_map",
    "MapError": "loops.saved_map",
    "SavedMap": "loops.saved_map",
    "read_map": "loops.saved_map",
    "read_manifest": "loops.saved_map",
    "checkpoint_refusal": "loops.saved_map",
    "write_manifest": "loops.saved_map",
    "LocaliseConfig": "loops.localise",
    "MapLocaliser": "loops.localise",
    "NOT_RETRIEVED": "loops.localise",
    "Verdict": "loops.localise",
    "keyframe_in_world": "loops.localise",
    "map_refusal": "loops.localise",
    "query_of": "loops.localise",
}

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_names(__name__, _HOMES)
