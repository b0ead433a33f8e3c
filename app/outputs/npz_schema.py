"""The npz schema of one frame: the arrays of `predictions/NNNNNN.npz`, their dtypes and shapes, and what a
run chooses to store (PredictionOutputs: depth precision, images, which frames).

One definition that the writer, the readers (app.outputs.npz_reading) and the tests use; numpy only, so that the
run options built on PredictionOutputs can be read without loading the model's libraries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from stream_recon.models import FramePrediction


@dataclass(frozen=True)
class NpzField:
    """One array of a prediction file: its dtype and shape ("H", "W": the model input's size)."""

    dtype: type
    shape: tuple[int | str, ...]

    @property
    def is_scalar(self) -> bool:
        return self.shape == ()

    def array(self, value: Any) -> np.ndarray:
        array = np.asarray(value, dtype=self.dtype)
        if all(isinstance(size, int) for size in self.shape):
            array = array.reshape(self.shape)
        return array


# DESIGN.md §5. Every one of these is in every file; scalars are read back as Python values.
PREDICTION_FIELDS: dict[str, NpzField] = {
    "frame_index": NpzField(np.int64, ()),
    "timestamp": NpzField(np.float64, ()),
    "is_keyframe": NpzField(np.bool_, ()),
    "frame_type": NpzField(np.int64, ()),
    "pose_enc": NpzField(np.float32, (9,)),
    "c2w": NpzField(np.float32, (3, 4)),
    "intrinsics": NpzField(np.float32, (3, 3)),
    "depth": NpzField(np.float32, ("H", "W")),
    "depth_conf": NpzField(np.float32, ("H", "W")),
    "image_size": NpzField(np.int64, (2,)),
    "chunk_index": NpzField(np.int64, ()),
}
# Keys runs written before a rename may carry, read under their current name.
RENAMED_FIELDS = {"window_index": "chunk_index"}
# The model input, written only when the prediction carries it; read back as None when absent.
IMAGE_FIELD = NpzField(np.uint8, ("H", "W", 3))
# The pixels left out of every point (app.outputs.masks: the sky, the user's masks), 1 = dropped; written only by a
# run that masks (--mask-sky, --mask-dir), read back as None when absent.
SKY_MASK_FIELD = NpzField(np.uint8, ("H", "W"))

# The per-pixel floats may be stored in half precision (`--save-depth float16`): half their bytes
# (0.78 MB instead of 1.57 MB a frame at 518x378), a relative error of at most 2**-11 = 0.049% for
# values in float16's normal range (6.1e-5 .. 65504), larger values stored as 65504. Readers get
# float32 either way.
HALVABLE_FIELDS = ("depth", "depth_conf")
DEPTH_STORAGE = {"float16": np.float16, "float32": np.float32}
SAVE_PREDICTIONS = ("all", "keyframes")
_FLOAT16_MAX = float(np.finfo(np.float16).max)


def prediction_arrays(pred: FramePrediction) -> dict[str, np.ndarray]:
    """The npz payload of one frame at full precision, plus `image` when the prediction carries it."""
    arrays = {key: field.array(getattr(pred, key)) for key, field in PREDICTION_FIELDS.items()}
    if pred.image is not None:
        arrays["image"] = IMAGE_FIELD.array(pred.image)
    return arrays


@dataclass(frozen=True)
class PredictionOutputs:
    """What a run writes per frame: RunOptions' save_depth, save_images and save_predictions.

    Bytes of one 518x378 frame: float32 with the image 2.16 MB; float16 with the image 1.37 MB;
    float16 without it 0.79 MB. The image is the model input (the source holds it too, resized).
    """

    depth: str = "float16"  # float16 | float32: depth and depth_conf on disk
    images: bool = True  # the model input [H, W, 3] uint8, when the prediction carries it
    frames: str = "all"  # all | keyframes: which frames get an npz (every pose is in trajectory_tum.txt)

    def __post_init__(self) -> None:
        if self.depth not in DEPTH_STORAGE:
            raise ValueError(f"--save-depth must be one of {', '.join(DEPTH_STORAGE)}, got {self.depth!r}")
        if self.frames not in SAVE_PREDICTIONS:
            raise ValueError(f"--save-predictions must be one of {', '.join(SAVE_PREDICTIONS)}, got {self.frames!r}")

    def writes(self, pred: FramePrediction) -> bool:
        return self.frames == "all" or pred.is_keyframe

    def stored(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """prediction_arrays' payload as this run stores it."""
        stored = dict(arrays)
        if not self.images:
            stored.pop("image", None)
        if self.depth == "float16":
            for key in HALVABLE_FIELDS:
                stored[key] = np.clip(arrays[key], -_FLOAT16_MAX, _FLOAT16_MAX).astype(np.float16)
        return stored
