"""Loop detection for a chunked stream: retrieval, then a geometric check of each candidate.

One keyframe at a time, in the order emitted (not always frame order: see KeyframeIndex.add): it queries the index of earlier keyframes
(`KeyframeIndex`, outside its own and the previous chunk), each candidate is checked against it
geometrically (`check_pair`), and then the keyframe joins the index. The descriptor is the caller's:
the model's GeM descriptor (`gem_descriptor` of the keyframe's patch tokens) or the weight-free
`gradient_grid_descriptor`; `add_image` is the weight-free path that computes both the descriptor
and the features from the picture.

The detector keeps each keyframe's SIFT features (~65 kB for 500 keypoints) so that a later keyframe
can be checked against it without the old picture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

from .geometric_check import (
    FeatureConfig,
    GeometricCheck,
    GeometricCheckConfig,
    ImageFeatures,
    check_pair,
    extract_features,
)
from .retrieval import KeyframeIndex, LoopCandidate, RetrievalConfig, gradient_grid_descriptor


@dataclass(frozen=True)
class LoopDetectionConfig:
    retrieval: RetrievalConfig = RetrievalConfig()
    features: FeatureConfig = FeatureConfig()
    check: GeometricCheckConfig = GeometricCheckConfig()


@dataclass(frozen=True)
class CheckedCandidate:
    """A query keyframe, one retrieved earlier keyframe, and the geometric check of the two."""

    query_frame: int
    query_chunk: int
    candidate: LoopCandidate
    check: GeometricCheck

    @property
    def accepted(self) -> bool:
        return self.check.passed


@dataclass(frozen=True)
class _Keyframe:
    features: ImageFeatures
    intrinsics: np.ndarray | None  # [3, 3] in the image's pixels


class LoopDetector:
    """Retrieval plus geometric check over a stream's keyframes."""

    def __init__(self, descriptor_dim: int, config: LoopDetectionConfig = LoopDetectionConfig()):
        self.config = config
        self.index = KeyframeIndex(descriptor_dim)
        self._keyframes: dict[int, _Keyframe] = {}

    def __len__(self) -> int:
        return len(self.index)

    def add_keyframe(self, frame_index: int, chunk_index: int, descriptor: np.ndarray | torch.Tensor,
                     features: ImageFeatures, intrinsics: np.ndarray | None = None) -> list[CheckedCandidate]:
        """Query with the keyframe, check every candidate, then add the keyframe. Returns every checked
        candidate, best retrieval score first; `accepted` ones are loop closures."""
        candidates = self.index.candidates(descriptor, chunk_index, self.config.retrieval)
        checked = [CheckedCandidate(frame_index, chunk_index, candidate,
                                    self._check(features, intrinsics, self._keyframes[candidate.frame_index]))
                   for candidate in candidates]
        self.index.add(descriptor, frame_index, chunk_index)
        self._keyframes[frame_index] = _Keyframe(features, None if intrinsics is None else np.asarray(intrinsics))
        return checked

    def add_image(self, frame_index: int, chunk_index: int, image: np.ndarray,
                  intrinsics: np.ndarray | None = None) -> list[CheckedCandidate]:
        """The weight-free path: an RGB uint8 image [H, W, 3] -> gradient-grid descriptor and SIFT
        features -> `add_keyframe`. The detector's descriptor_dim must be 128."""
        return self.add_keyframe(frame_index, chunk_index, gradient_grid_descriptor(image),
                                 extract_features(image, self.config.features), intrinsics)

    def _check(self, features: ImageFeatures, intrinsics: np.ndarray | None, earlier: _Keyframe) -> GeometricCheck:
        return check_pair(features, earlier.features, intrinsics, earlier.intrinsics, self.config.check)
