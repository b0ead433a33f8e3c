"""Chunks: how a long stream is cut, and how each chunk's predictions land in one world frame.

A *chunk* is an independent stream of at most `chunk_frames` cached frames (320 by default, the
views per sequence the released checkpoints were trained with) with a fresh cache; "window" means
only the sliding window of keyframes inside one chunk's cache (cache/). Chunk n+1 starts `overlap`
frames before the end of chunk n and predicts those frames again (they are its scale frames); the
shared frames give a similarity (Sim(3), models/stream/similarity.py) that maps chunk n+1 onto the already
aligned chunk n, hence into chunk 0's world frame (spec MODEL.md §14).

`check_chunking` refuses a cut the model cannot stream. `ChunkAlignment` is that bookkeeping and nothing else: it takes one chunk's predictions in stream
order, holds the first `shared` of them until the chunk's transform can be estimated, and emits
them mapped into the world frame. It keeps the last `overlap` emitted frames (the tail the next
chunk is aligned on) and each chunk's transform. It never runs the model.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from .pose import decode_pose
from .prediction import FramePrediction
from .similarity import FrameRatios, Sim3, alignment_frames, estimate_chunk_alignment, overlap_covariance
from .stream_config import TRAINED_VIEWS

logger = logging.getLogger("stream_recon.models.stream.chunks")


@dataclass(frozen=True)
class AlignedFrame:
    """What a later chunk needs of a frame to align itself: its final pose and depth."""

    frame_index: int
    pose_enc: np.ndarray  # [9]
    depth: np.ndarray  # [H, W]
    is_keyframe: bool


@dataclass(frozen=True)
class ChunkLink:
    """How chunk `index` was hung on chunk `index - 1` at its rollover: an odometry edge of the pose graph
    over chunks (models/loops/pose_graph.py).

    Chunks are counted as the stream counts them, from 0; chunk 0 hangs on nothing, so links start at
    index 1. The pose graph counts its odometry edges from 0: link `index` is the graph's odometry edge
    index - 1, between chunks index - 1 and index.
    """

    index: int
    previous_from_next: Sim3  # chunk `index` coordinates -> chunk `index - 1` coordinates
    sigmas: np.ndarray  # [7] the square roots of `covariance`'s diagonal, in the pose graph's tangent order
    num_shared: int
    # [7, 7] how sure the alignment is, from the shared frames' disagreement (similarity.overlap_covariance):
    # its error in the tangent at chunk `index`'s origin. None: the sigmas' components are independent.
    covariance: np.ndarray | None = None


@dataclass(frozen=True)
class ClosedChunk:
    """A chunk after its rollover, while the next one catches up on the spare engine: it still predicts
    new frames (uncached, in its own coordinates) so that the stream need not wait."""

    start: int  # stream index of its first frame
    index: int
    transform: Sim3  # chunk -> world


class ChunkAlignment:
    """The current chunk's predictions -> emissions in the world frame (chunk 0's coordinates).

    Invariants: `transform` is None exactly while the current chunk's first `num_shared` predictions
    are held (chunk 0 has the identity and shares nothing); `transforms` has one entry per chunk whose
    transform is known; `tail` holds the last `overlap` frames emitted for the current chunk and
    `previous_tail` the closed chunk's last `num_shared`, which the current chunk re-predicts.
    `early_ratios` holds the depth ratios of frames of the next transform, made before it is estimated
    (a bisected median at the rollover instead of one over all pixels).
    """

    def __init__(self, overlap: int):
        self.tail: deque[AlignedFrame] = deque(maxlen=overlap)
        self.reset()

    def reset(self) -> None:
        """Chunk 0 at stream index 0, with the identity."""
        self.index = 0
        self.start = 0  # stream index of the current chunk's first frame
        self.transform: Sim3 | None = Sim3.identity()
        self.transforms: list[Sim3] = [Sim3.identity()]
        self.links: list[ChunkLink] = []  # one per chunk after the first, once its transform is known
        self.num_shared = 0  # frames the current chunk re-predicts from the previous one
        self.previous_tail: list[AlignedFrame] = []
        self.held: list[FramePrediction] = []  # raw predictions waiting for the chunk's transform
        self.early_ratios: dict[int, FrameRatios] = {}  # frame index -> its ratios, for the next transform
        self.tail.clear()

    def closed(self) -> ClosedChunk:
        return ClosedChunk(self.start, self.index, self.transform)

    def open_next(self, start: int, shared: int) -> None:
        """The next chunk starts at stream index `start` and re-predicts the last `shared` frames."""
        self.previous_tail = list(self.tail)[len(self.tail) - shared:]
        self.tail.clear()
        self.index += 1
        self.start = start
        self.num_shared = shared
        self.transform = None
        self.held = []

    def forget(self) -> None:
        """The current chunk as if none of its frames were received (its frames are predicted again)."""
        if self.transform is not None:
            self.transforms.pop()
            self.links.pop()
        self.transform, self.held = None, []
        self.tail.clear()

    def receive(self, raw_predictions: list[FramePrediction]) -> list[FramePrediction]:
        """Chunk-local predictions in stream order -> emissions in the world frame."""
        for raw in raw_predictions:
            self.held.append(replace(raw, frame_index=self.start + raw.frame_index, chunk_index=self.index))
        if self.transform is None:
            if len(self.held) < self.num_shared:
                return []
            self.transform = self._estimate_transform(self.held[: self.num_shared])
        emitted = aligned(self.held, self.transform)
        self.held = []
        self.tail.extend(AlignedFrame(a.frame_index, a.pose_enc, a.depth, a.is_keyframe) for a in emitted)
        return emitted

    def provisional(self, closed: ClosedChunk, raws: list[FramePrediction]) -> list[FramePrediction]:
        """A closed chunk's uncached predictions, in the world frame like its own."""
        return aligned([replace(raw, frame_index=closed.start + raw.frame_index, chunk_index=closed.index,
                                provisional=True) for raw in raws], closed.transform)

    def make_ratios(self, raws: list[FramePrediction], start: int, tail: Iterable[AlignedFrame],
                    limit: int | None = None) -> int:
        """FrameRatios of each prediction in `raws` of the chunk starting at stream index `start` that
        the chunk before it has emitted too (`tail`), both as keyframes (the pairs); at most `limit`
        new ones. Returns how many pairs in `raws` are still without."""
        tail = {frame.frame_index: frame for frame in tail}
        missing = 0
        for raw in raws:
            index = start + raw.frame_index
            previous = tail.get(index)
            if index in self.early_ratios or previous is None or not (raw.is_keyframe and previous.is_keyframe):
                continue
            if limit is not None and limit <= 0:
                missing += 1
                continue
            self.early_ratios[index] = FrameRatios.of(previous.depth, raw.depth)
            limit = None if limit is None else limit - 1
        return missing

    def _estimate_transform(self, shared: list[FramePrediction]) -> Sim3:
        previous = self.previous_tail
        assert [p.frame_index for p in previous] == [s.frame_index for s in shared]
        ratios = {k: self.early_ratios[s.frame_index] for k, s in enumerate(shared)
                  if s.frame_index in self.early_ratios}
        previous_pose_enc = np.stack([p.pose_enc for p in previous])  # [K, 9] each
        shared_pose_enc = np.stack([s.pose_enc for s in shared])
        previous_keyframe = np.array([p.is_keyframe for p in previous])
        shared_keyframe = np.array([s.is_keyframe for s in shared])
        transform = estimate_chunk_alignment(previous_pose_enc, [p.depth for p in previous], previous_keyframe,
                                             shared_pose_enc, [s.depth for s in shared], shared_keyframe, ratios)
        self.early_ratios = {}
        self.transforms.append(transform)
        anchor, depth_rows = alignment_frames(previous_keyframe, shared_keyframe)
        covariance = overlap_covariance(previous_pose_enc, shared_pose_enc, transform, anchor,
                                        [ratios[k] for k in depth_rows.tolist() if k in ratios])
        self.links.append(ChunkLink(self.index, self.transforms[-2].inverse() @ transform,
                                    np.sqrt(np.diag(covariance)), len(shared), covariance))
        logger.info("chunk %d aligned on %d shared frames: scale %.6f, rotation %.2f deg, translation %s",
                    self.index, len(shared), transform.scale, transform.rotation_deg,
                    np.round(transform.translation, 4))
        return transform


def aligned(raws: list[FramePrediction], transform: Sim3) -> list[FramePrediction]:
    """Predictions mapped into the world frame by their chunk's transform. Chunk 0's predictions pass
    unchanged (their pose_enc is the model's own); later chunks' cameras are moved by the chunk's
    Sim(3), their quaternions keeping the model's norm (Sim3.apply_to_pose_enc), and their depth
    scaled. All at once: a rollover aligns ~17 frames in one push."""
    if not raws or transform.is_identity:
        return raws
    pose_enc = transform.apply_to_pose_enc(np.stack([raw.pose_enc for raw in raws]).astype(np.float64))
    pose_enc = pose_enc.astype(np.float32)
    height, width = raws[0].image_size  # one stream, one frame size
    c2w, intrinsics = decode_pose(pose_enc, height, width)
    scale = np.float32(transform.scale)
    return [replace(raw, pose_enc=pose_enc[k], c2w=c2w[k], intrinsics=intrinsics[k], depth=raw.depth * scale)
            for k, raw in enumerate(raws)]


def check_chunking(chunk_frames: int, overlap: int, scale_frames: int, max_frames: int) -> None:
    """Refuse chunk settings the model cannot stream (ValueError, naming the settings)."""
    if chunk_frames <= scale_frames:
        raise ValueError(
            f"chunk_frames={chunk_frames} must be larger than scale_frames={scale_frames}: a chunk needs "
            "room for at least one streaming keyframe"
        )
    if chunk_frames > max_frames:
        raise ValueError(
            f"chunk_frames={chunk_frames} exceeds the model's temporal RoPE table "
            f"({max_frames} positions); use at most {TRAINED_VIEWS}, the trained range"
        )
    if not 1 <= overlap < chunk_frames:
        raise ValueError(
            f"overlap={overlap} must be between 1 and chunk_frames - 1 = {chunk_frames - 1}: chunks are "
            "aligned on the frames they share"
        )
    if chunk_frames > TRAINED_VIEWS:
        logger.warning("chunk_frames=%d is beyond the %d views the model was trained with; quality may degrade",
                       chunk_frames, TRAINED_VIEWS)
