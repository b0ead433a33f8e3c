"""Loop-closure retrieval: a global descriptor per keyframe and the index that finds earlier look-alikes.

Two descriptors feed the same index:

- the model's: generalised-mean (GeM) pooling of its DINO patch tokens (models/descriptor.py, where
  the network makes it).
- `gradient_grid_descriptor`: needs no weights. Gradient-orientation histograms on a 4 x 4 grid of a
  small grey image (HOG/GIST-like), square-rooted, centred and L2-normalised. It keeps the coarse
  layout of edges (a corridor's vanishing lines, door frames, shelves), which is what tells one end of
  an office from another when the same camera returns; it is the stand-in for tests and CI, and for
  runs whose model descriptor means nothing (synthetic weights).

`KeyframeIndex` keeps the descriptors of a stream's keyframes and answers "which earlier keyframes,
outside the current and the previous chunk, look like this one": cosine similarity above a
threshold, non-maximum suppression over frame indices, top-k.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import cv2
import numpy as np

if TYPE_CHECKING:
    import torch

# -- descriptors -------------------------------------------------------------------------------------
GRID_ROWS, GRID_COLS = 4, 4  # 16 cells: coarse enough to survive a few frames of walking, fine enough to keep layout
ORIENTATION_BINS = 8  # unsigned orientations, 22.5 degrees a bin
GRID_IMAGE_SIZE = (128, 72)  # (width, height) the frame is resized to: 32 x 18 pixels a cell, any aspect
# Below this mean Sobel magnitude (grey levels in [0, 1]) a frame is flat: a blank or covered camera
# (rounding leaves ~1e-7); the fixture's frames average 0.11-0.34.
FLAT_GRADIENT = 1e-3


def gradient_grid_descriptor(image: np.ndarray) -> np.ndarray:
    """A weight-free global descriptor of an RGB uint8 image [H, W, 3] (or grey [H, W]) -> [128] float32.

    The image is resized to 128 x 72 and its Sobel gradients binned into 8 unsigned orientations per
    cell of a 4 x 4 grid, weighted by magnitude. Square-rooting the histograms (as RootSIFT) keeps a
    few strong edges from dominating; subtracting the vector's mean before L2 normalisation makes the
    cosine a correlation, spread over [-1, 1] instead of crowded near 1 as any two non-negative
    histograms are (fixture: unrelated pairs median 0.45, the loop 0.51-0.77; uncentred, unrelated
    pairs reached 0.95). A frame without gradients (flat) gives the zero vector.
    """
    grey = image if image.ndim == 2 else cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
    grey = cv2.resize(grey.astype(np.float32) / 255.0, GRID_IMAGE_SIZE, interpolation=cv2.INTER_AREA)
    gx = cv2.Sobel(grey, cv2.CV_32F, 1, 0)
    gy = cv2.Sobel(grey, cv2.CV_32F, 0, 1)
    magnitude = np.hypot(gx, gy)
    if magnitude.mean() < FLAT_GRADIENT:
        return np.zeros(GRID_ROWS * GRID_COLS * ORIENTATION_BINS, np.float32)
    orientation = np.mod(np.arctan2(gy, gx), np.pi)  # unsigned: an edge reads the same from either side
    bins = np.minimum((orientation * (ORIENTATION_BINS / np.pi)).astype(np.int64), ORIENTATION_BINS - 1)
    height, width = grey.shape
    rows = np.arange(height) * GRID_ROWS // height  # [H] grid row of each pixel row
    cols = np.arange(width) * GRID_COLS // width  # [W]
    cell = rows[:, None] * GRID_COLS + cols[None, :]  # [H, W]
    histogram = np.bincount((cell * ORIENTATION_BINS + bins).ravel(), weights=magnitude.ravel(),
                            minlength=GRID_ROWS * GRID_COLS * ORIENTATION_BINS)
    descriptor = np.sqrt(histogram)
    descriptor -= descriptor.mean()
    return _unit(descriptor).astype(np.float32)


def _unit(vectors: np.ndarray) -> np.ndarray:
    """L2-normalise along the last axis; a zero vector stays zero."""
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return np.divide(vectors, norms, out=np.zeros_like(vectors), where=norms > 1e-12)


# -- the index ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RetrievalConfig:
    """What the index returns for a query. The defaults are the weight-free descriptor's (see
    docs/loop_closure.md for the figures behind them); the model's GeM descriptor needs its own
    `min_similarity`, measured with the real weights."""

    top_k: int = 3  # candidates per query: each costs one geometric check (~10-30 ms on a CPU core)
    # The fixture's loop queries found their match at 0.51-0.77, but two thirds of its unrelated pairs
    # also score >= 0.4: the descriptor ranks, the geometric check decides; this only skips the hopeless.
    min_similarity: float = 0.4
    suppression_frames: int = 9  # neighbours within 9 frames (0.3 s at 30 fps) see the same place
    excluded_chunks: int = 2  # the query's chunk and the one before it: drift there is not yet a loop

    def __post_init__(self):
        if self.top_k < 1 or self.suppression_frames < 0 or self.excluded_chunks < 1:
            raise ValueError(f"invalid retrieval config {self}")


@dataclass(frozen=True)
class LoopCandidate:
    """An earlier keyframe that looks like the query."""

    frame_index: int
    chunk_index: int
    similarity: float  # cosine of the two descriptors


class KeyframeIndex:
    """The descriptors of a stream's keyframes, in the order added, as one [N, D] float32 matrix.

    A brute-force matrix product answers a query in well under a millisecond below ~10^4 keyframes;
    storage doubles when full, so adding is amortised O(D).
    """

    def __init__(self, dim: int, initial_capacity: int = 256):
        if dim < 1 or initial_capacity < 1:
            raise ValueError(f"KeyframeIndex needs dim >= 1 and capacity >= 1, got {dim}, {initial_capacity}")
        self.dim = dim
        self._descriptors = np.zeros((initial_capacity, dim), np.float32)  # [capacity, D], unit rows
        self._frames = np.zeros(initial_capacity, np.int64)  # [capacity]
        self._chunks = np.zeros(initial_capacity, np.int64)  # [capacity]
        self._frame_set: set[int] = set()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        return len(self._frames)

    @property
    def frame_indices(self) -> np.ndarray:
        """[N] the keyframes' frame indices, in the order added (a copy)."""
        return self._frames[: self._size].copy()

    def add(self, descriptor: np.ndarray | torch.Tensor, frame_index: int, chunk_index: int) -> None:
        """Append a keyframe; each frame once. Keyframes may come in any order: around a flow chunk's
        rollover the closed chunk's last keyframes are emitted after the next chunk's first ones (a frame
        that was no keyframe in the closed chunk becomes one of the next chunk's scale frames)."""
        vector = self._as_unit_vector(descriptor)
        if frame_index in self._frame_set:
            raise ValueError(f"keyframe (frame {frame_index}, chunk {chunk_index}) is in the index already")
        self._frame_set.add(frame_index)
        if self._size == self.capacity:
            self._grow()
        self._descriptors[self._size] = vector
        self._frames[self._size] = frame_index
        self._chunks[self._size] = chunk_index
        self._size += 1

    def similarities(self, query: np.ndarray | torch.Tensor) -> np.ndarray:
        """[N] cosine similarity of the query with every keyframe, in the order added."""
        return self._descriptors[: self._size] @ self._as_unit_vector(query)

    def candidates(self, query: np.ndarray | torch.Tensor, chunk_index: int,
                   config: RetrievalConfig = RetrievalConfig()) -> list[LoopCandidate]:
        """Up to `top_k` keyframes at least `excluded_chunks` chunks before `chunk_index` whose similarity
        is >= `min_similarity`, best first (ties: the earlier frame), none within `suppression_frames`
        frames of a better one."""
        similarities = self.similarities(query)
        eligible = (self._chunks[: self._size] <= chunk_index - config.excluded_chunks) & (
            similarities >= config.min_similarity)
        positions = np.flatnonzero(eligible)
        order = positions[np.lexsort((self._frames[positions], -similarities[positions]))]
        kept: list[int] = []
        for position in order:  # greedy non-maximum suppression: only kept candidates suppress
            frame = self._frames[position]
            if all(abs(frame - self._frames[other]) > config.suppression_frames for other in kept):
                kept.append(position)
                if len(kept) == config.top_k:
                    break
        return [LoopCandidate(int(self._frames[i]), int(self._chunks[i]), float(similarities[i])) for i in kept]

    def _as_unit_vector(self, descriptor: np.ndarray | torch.Tensor) -> np.ndarray:
        torch = sys.modules.get("torch")  # a tensor comes from a process that imported torch: refine's children do not
        if torch is not None and isinstance(descriptor, torch.Tensor):
            descriptor = descriptor.detach().float().cpu().numpy()
        vector = np.asarray(descriptor, np.float32)
        if vector.shape != (self.dim,) or not np.all(np.isfinite(vector)):
            raise ValueError(f"a descriptor is a finite [{self.dim}] vector, got shape {vector.shape}")
        return _unit(vector)

    def _grow(self) -> None:
        self._descriptors = np.concatenate([self._descriptors, np.zeros_like(self._descriptors)])
        self._frames = np.concatenate([self._frames, np.zeros_like(self._frames)])
        self._chunks = np.concatenate([self._chunks, np.zeros_like(self._chunks)])
