"""What the streaming engine hands to everything downstream: one record per frame."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Why a frame is in the stream, as the reference records it (`frame_type`).
FRAME_SCALE = 0  # anchor frame of phase 1; its patch K/V is never evicted
FRAME_KEY = 1  # committed streaming frame
FRAME_NON_KEY = 2  # predicted, then rolled back: it leaves no trace in any cache

# `depth_conf` is 1 + exp(logit): at this value the logit is 0, and above it the model is more sure of a
# pixel's depth than not. The default threshold of everything that keeps only confident depth reads it.
EVEN_ODDS_CONFIDENCE = 2.0


@dataclass
class FramePrediction:
    """Outputs for one input frame, on the host, float32.

    Cameras follow OpenCV axes (x right, y down, z forward); `c2w` maps camera to world
    coordinates, so its last column is the camera centre. The world is the model's own frame
    (first frame at the origin up to the model's accuracy), in the model's unknown scale.

    Chunked streams (long runs) may emit the same `frame_index` twice: once when first
    predicted and again, aligned into chunk 0's frame, when a later chunk re-predicts it. Sinks
    overwrite by `frame_index`; the last emission is final. While a new chunk catches up after a
    rollover, the closed chunk predicts the new frames once more without caching them
    (`provisional`): the new chunk emits each of them again shortly after.
    """

    frame_index: int  # position in the stream, from 0
    timestamp: float  # seconds, from the source
    frame_type: int  # FRAME_SCALE | FRAME_KEY | FRAME_NON_KEY
    pose_enc: np.ndarray  # [9] t_xyz, quat_xyzw (unnormalised), fov_h, fov_w (radians)
    c2w: np.ndarray  # [3, 4] camera-to-world [R | t]
    intrinsics: np.ndarray  # [3, 3] pixels, for the model's input size (H, W)
    depth: np.ndarray  # [H, W] z-depth along the optical axis
    depth_conf: np.ndarray  # [H, W] confidence, >= 1
    image: np.ndarray | None = None  # [H, W, 3] uint8 RGB, the model input the outputs refer to
    chunk_index: int = 0  # which chunk of a chunked stream produced this emission
    flow_magnitude: float = float("nan")  # flow keyframe policy: mean flow (px) to the last keyframe
    provisional: bool = False  # a closed chunk's prediction, emitted again (final) by the next chunk
    descriptor: np.ndarray | None = None  # [C] unit-length descriptor of its tokens, where the policy reads them

    @property
    def is_keyframe(self) -> bool:
        return self.frame_type != FRAME_NON_KEY

    @property
    def image_size(self) -> tuple[int, int]:
        """(H, W) of the model input."""
        return int(self.depth.shape[0]), int(self.depth.shape[1])
