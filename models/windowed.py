"""Windowed streaming for streams of unknown length (spec MODEL.md §14).

The model was trained on up to 320 views and its temporal RoPE table stops at 1024 positions, so an
unbounded stream is cut into windows, each an independent stream with a fresh cache. Window n+1
starts `overlap` frames before the end of window n and predicts those frames again (they are its
scale frames); the shared frames give a similarity (Sim(3)) that maps window n+1 onto the already
aligned window n, hence into the first window's world frame.

Windows and emissions for 14 frames, scale_frames=3, window_frames=6, overlap=3, keyframes all::

    frame      0  1  2  3  4  5  6  7  8  9 10 11 12 13
    window 0   S  S  S  K  K  K
    window 1            S  S  S  K  K  K
    window 2                     S  S  S  K  K  K
    window 3                              S  S  S  K  K

Every frame is emitted when it is first predicted, already in the first window's frame. A window
n > 0 holds back its predictions of the shared frames until it has predicted all of them (its
transform needs them); with overlap >= scale_frames that happens inside the `push` of the frame
that opened the window, which then returns the re-predicted shared frames followed by the new one.
With the lookahead (a spare engine that predicted the shared frames beside the stream), that push
returns only the closing window's last frame, and the next push returns the rest: the same
emissions in the same order, the pause split between two frame intervals.
The last emission of every frame_index is the reference's stitched result: the shared frames come
from the later window.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from .engine import StreamConfig, StreamingEngine
from .gct import GCTStream
from .lookahead import SpareEngine
from .memory import estimate_memory, gib
from .pose import decode_pose, quat_xyzw_product, quat_xyzw_to_rotation, rotation_to_quat_xyzw
from .prediction import FramePrediction

logger = logging.getLogger("stream_recon.models.windowed")

TRAINED_VIEWS = 320  # views per sequence the released checkpoints were trained with
_DEPTH_EPS = float(np.finfo(np.float32).eps)  # the reference's "depth is not zero" threshold
_SCALE_RANGE = (1e-3, 1e3)
# Once its scale step is done, the spare engine may be this many queued frames behind when the stream
# takes a frame: more, and the stream waits for it (SpareEngine.catch_up).
SPARE_BEHIND = 1


# -- Sim(3) helpers (float64, numpy) -------------------------------------------------------------
@dataclass(frozen=True)
class Sim3:
    """x -> scale * rotation @ x + translation: maps one window's world frame into another's."""

    scale: float
    rotation: np.ndarray  # [3, 3]
    translation: np.ndarray  # [3]

    @classmethod
    def identity(cls) -> Sim3:
        return cls(1.0, np.eye(3), np.zeros(3))

    @property
    def matrix(self) -> np.ndarray:
        """[4, 4] [R | t] without the scale, as the reference's `chunk_transforms`."""
        out = np.eye(4)
        out[:3, :3] = self.rotation
        out[:3, 3] = self.translation
        return out

    def apply_to_points(self, points: np.ndarray) -> np.ndarray:
        """[..., 3] -> [..., 3]."""
        return self.scale * np.asarray(points, np.float64) @ self.rotation.T + self.translation

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and np.array_equal(self.rotation, np.eye(3)) and not self.translation.any()

    def apply_to_pose_enc(self, pose_enc: np.ndarray) -> np.ndarray:
        """[..., 9] camera-to-world pose encodings -> the same cameras in the target frame.

        The camera centre moves as a point; the orientation is left-multiplied by the rotation as
        a quaternion product with the rotation's unit quaternion, so the result keeps the model's
        quaternion norm (the model's quaternions are not unit; the decoder divides by |q|^2) and
        its rotation is R @ R(q); the field of view is unchanged. (The reference re-encodes a unit
        quaternion with w >= 0 instead: the same cameras, another encoding.)
        """
        pose_enc = np.asarray(pose_enc)
        out = pose_enc.astype(np.float64, copy=True)
        out[..., :3] = self.apply_to_points(pose_enc[..., :3])
        out[..., 3:7] = quat_xyzw_product(rotation_to_quat_xyzw(self.rotation), out[..., 3:7])
        return out.astype(pose_enc.dtype)


def depth_ratios(target_depth: np.ndarray, source_depth: np.ndarray) -> np.ndarray:
    """target / source [N] at the pixels where both are finite and the source is not ~0.

    One frame's (or several frames') depth as predicted by two windows, any shape. The division is
    float32, as the reference divides (float32 tensors), so every ratio is the reference's to the bit.
    """
    target = np.asarray(target_depth, np.float32).ravel()
    source = np.asarray(source_depth, np.float32).ravel()
    valid = np.isfinite(target) & np.isfinite(source) & (np.abs(source) > _DEPTH_EPS)
    return target[valid] / source[valid]


@dataclass(frozen=True)
class FrameRatios:
    """One frame's depth ratios, arranged beforehand so that a median over many frames is quick.

    The median of ~3 million ratios (16 frames at the defaults) took 20-80 ms at a rollover on the
    GPU machine's host, where the stream waits for it. Here each frame's values are bucketed by the
    top 16 bits of an order-preserving key and laid out bucket by bucket, when the frame is known;
    the median then sums the frames' counts to find its bucket and selects among that bucket's
    values alone (a slice of each frame).
    """

    by_bucket: np.ndarray  # [N] float32: the frame's ratios, bucket by bucket (ascending keys)
    ends: np.ndarray  # [65536] int64: by_bucket[ends[b - 1]:ends[b]] are bucket b's values

    @classmethod
    def of(cls, target_depth: np.ndarray, source_depth: np.ndarray) -> FrameRatios:
        values = depth_ratios(target_depth, source_depth)
        bits = values.view(np.uint32)
        # IEEE float32 bits -> unsigned keys in the order of the values: negatives have every bit
        # flipped (larger magnitude, smaller key), non-negatives get the sign bit set.
        keys = np.where(bits >> 31 == 1, ~bits, bits | np.uint32(0x80000000))
        bucket = (keys >> 16).astype(np.uint16)
        order = np.argsort(bucket, kind="stable")  # a radix sort for 16-bit keys
        return cls(values[order], np.cumsum(np.bincount(bucket, minlength=1 << 16)))

    @property
    def size(self) -> int:
        return self.by_bucket.size

    def bucket(self, index: int) -> np.ndarray:
        return self.by_bucket[self.ends[index - 1] if index else 0 : self.ends[index]]


def median_ratio_scale(frames: Sequence[FrameRatios | np.ndarray]) -> float:
    """The lower middle value of all the frames' ratios (torch.median's rule, which the reference
    uses), clamped to [1e-3, 1e3] as float32 like the reference's; 1.0 when there is none.

    Each frame is a FrameRatios, or its depth_ratios as they are: with every frame a FrameRatios the
    selection reads only the median's bucket; otherwise it partitions all the values (what arranging
    them would cost first, when none is arranged yet).
    """
    frames = [frame for frame in frames if frame.size]
    if not frames:
        return 1.0
    if all(isinstance(frame, FrameRatios) for frame in frames):
        below = np.sum([frame.ends for frame in frames], axis=0)  # [65536] values in buckets <= b, all frames
        rank = (int(below[-1]) - 1) // 2  # 0-based rank of the lower median among all values
        bucket = int(np.searchsorted(below, rank, side="right"))
        rank -= int(below[bucket - 1]) if bucket else 0
        candidates = np.concatenate([frame.bucket(bucket) for frame in frames])
    else:
        candidates = np.concatenate([frame.by_bucket if isinstance(frame, FrameRatios) else frame for frame in frames])
        rank = (candidates.size - 1) // 2
    median = np.partition(candidates, rank)[rank]
    return float(np.clip(median, np.float32(_SCALE_RANGE[0]), np.float32(_SCALE_RANGE[1])))


def depth_ratio_scale(target_depth: np.ndarray, source_depth: np.ndarray) -> float:
    """Median of target / source over all pixels where both are finite and the source is not ~0.

    target_depth, source_depth [K, H, W] for the same K frames (spec §14's scale).
    """
    return median_ratio_scale([depth_ratios(target_depth, source_depth)])


def estimate_window_alignment(target_pose_enc: np.ndarray, target_depth: Sequence[np.ndarray],
                              target_keyframe: np.ndarray, source_pose_enc: np.ndarray,
                              source_depth: Sequence[np.ndarray], source_keyframe: np.ndarray,
                              ratios: Mapping[int, FrameRatios] | None = None) -> Sim3:
    """The Sim(3) taking the source window's predictions of the shared frames onto the target's.

    Inputs are the K shared frames in stream order, as predicted by each window: pose_enc [K, 9],
    depth K x [H, W], keyframe [K] bool (scale frames count as keyframes). Frames that are keyframes
    in both windows are paired; the last pair anchors rotation and translation (the first shared
    frame when there is no pair) and the depth of all pairs gives the scale (spec §14). `ratios`:
    the FrameRatios of some frames made beforehand, by position in the K.
    """
    paired = np.flatnonzero(np.asarray(target_keyframe, bool) & np.asarray(source_keyframe, bool))
    anchor = int(paired[-1]) if paired.size else 0
    depth_rows = paired if paired.size else np.array([0])
    ratios = ratios or {}
    scale = median_ratio_scale([ratios[k] if k in ratios else depth_ratios(target_depth[k], source_depth[k])
                                for k in depth_rows.tolist()])
    target_rotation = quat_xyzw_to_rotation(target_pose_enc[anchor, 3:7])
    source_rotation = quat_xyzw_to_rotation(source_pose_enc[anchor, 3:7])
    rotation = target_rotation @ source_rotation.T
    target_centre = np.asarray(target_pose_enc[anchor, :3], np.float64)
    source_centre = np.asarray(source_pose_enc[anchor, :3], np.float64)
    return Sim3(scale, rotation, target_centre - scale * rotation @ source_centre)


# -- the engine --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _AlignedFrame:
    """What a later window needs of a frame to align itself: its final pose and depth."""

    frame_index: int
    pose_enc: np.ndarray  # [9]
    depth: np.ndarray  # [H, W]
    is_keyframe: bool


class WindowedEngine:
    """A StreamingEngine that rolls over to a new window before the cache outgrows the model.

    A window holds up to `window_frames` cached frames (scale frames + keyframes): with
    `keyframes="interval:K"` it spans scale + (window_frames - scale) * K input frames; with
    `"flow"` it closes after its (window_frames - scale)-th keyframe. The next window starts
    `overlap` input frames back, which are kept in a ring of that many frames and one more (never
    the stream).
    Same interface as StreamingEngine; predictions carry `window_index`, and a frame predicted by
    two windows is emitted twice (the later emission is final).

    `lookahead`: predict the next window's shared frames beside the stream on a spare engine
    (models/lookahead.py), so that a rollover pauses it far less. None: where it helps and fits (a
    CUDA device, steps replayed as graphs, windows that close at a known frame, room for a second
    engine); True: also elsewhere (no gain on a CPU; for tests); False: never. The emissions are the
    same either way, in the same order; with the spare, a new window's come one push later.
    """

    def __init__(self, model: GCTStream, config: StreamConfig | None = None, *, window_frames: int = TRAINED_VIEWS,
                 overlap: int = 16, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 lookahead: bool | None = None):
        self.config = config or StreamConfig()
        policy = self.config.policy
        scale_frames = self.config.scale_frames
        if window_frames <= scale_frames:
            raise ValueError(
                f"window_frames={window_frames} must be larger than scale_frames={scale_frames}: a window needs "
                "room for at least one streaming keyframe"
            )
        if window_frames > model.config.max_frames:
            raise ValueError(
                f"window_frames={window_frames} exceeds the model's temporal RoPE table "
                f"({model.config.max_frames} positions); use at most {TRAINED_VIEWS}, the trained range"
            )
        if not 1 <= overlap < window_frames:
            raise ValueError(
                f"overlap={overlap} must be between 1 and window_frames - 1 = {window_frames - 1}: windows are "
                "aligned on the frames they share"
            )
        if window_frames > TRAINED_VIEWS:
            logger.warning("window_frames=%d is beyond the %d views the model was trained with; quality may degrade",
                           window_frames, TRAINED_VIEWS)
        self.window_frames = window_frames
        self.overlap = overlap
        self.dynamic_windows = policy.kind == "flow"
        interval = policy.interval if policy.kind == "interval" else 1
        # Input frames per window when keyframes follow a fixed rule (unused for flow).
        self.window_length = scale_frames + (window_frames - scale_frames) * interval
        # A window's cache holds its cached frames and one pending frame: the dense cache allocates
        # for that many (not the model's whole temporal range), which the memory plan counts.
        cached = min(window_frames + 1, model.config.max_frames)
        self.engine = StreamingEngine(model, replace(self.config, max_cached_frames=cached), device=device,
                                      dtype=dtype)
        self.model, self.device = self.engine.model, self.engine.device
        if lookahead and self.dynamic_windows:
            raise ValueError("lookahead needs windows that close at a known frame: keyframes 'all' or 'interval:N', "
                             "not 'flow'")
        self.lookahead = lookahead
        self._spare: SpareEngine | None = None
        self._warmup: list[tuple[torch.Tensor, float]] = []  # the first frames, to warm a spare on
        # the shared frames, and one more: a rollover beside the stream hands the spare the next frame too
        self._replay: deque[tuple[torch.Tensor, float]] = deque(maxlen=overlap + 1)
        self._tail: deque[_AlignedFrame] = deque(maxlen=overlap)
        self.reset()

    # -- public ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new stream: window 0, empty caches, no transforms."""
        self.engine.reset()
        if self._spare is not None:
            self._spare.discard()
        self._ahead_from: int | None = None  # the stream index from which the spare takes frames
        self._switch_pending = False  # a window closed; the spare, holding the next, takes over at the next call
        self._ahead_ready: list[FramePrediction] = []  # the spare's predictions taken before the rollover
        self._early_ratios: dict[int, FrameRatios] = {}  # frame index -> its ratios, for the next transform
        self.num_frames = 0
        self.window_index = 0
        self.window_start = 0  # stream index of the current window's first frame
        self.rollovers = 0
        self.rollovers_ahead = 0  # of them, those whose new window the spare had predicted already
        self.window_scales: list[float] = [1.0]
        self.window_transforms: list[np.ndarray] = [Sim3.identity().matrix]
        self._transform: Sim3 | None = Sim3.identity()
        self._num_shared = 0  # frames the current window re-predicts from the previous one
        self._previous_tail: list[_AlignedFrame] = []
        self._held: list[FramePrediction] = []  # raw predictions waiting for the window's transform
        self._outbox: list[FramePrediction] = []  # computed but not yet returned (a push that raised)
        self._replay.clear()
        self._tail.clear()

    def push(self, image: torch.Tensor | np.ndarray, timestamp: float | None = None) -> list[FramePrediction]:
        """Add frame [3, H, W]; returns the predictions emitted by it, oldest window first."""
        timestamp = float(self.num_frames) if timestamp is None else float(timestamp)
        frame = (torch.as_tensor(image).detach().clone(), timestamp)
        if self._switch_pending:
            self._switch_to_spare()
        if self._window_is_full():
            self._roll_over()
        if self._switch_pending:  # the window closed at this frame; the spare, holding the next, takes it
            self._spare.push(*frame)
        else:
            if self._ahead_from is not None:
                self._spare.catch_up(SPARE_BEHIND)
            self._outbox += self._receive(self.engine.push(image, timestamp))
        self._replay.append(frame)
        self._look_ahead(frame)
        self._take_ahead()
        self.num_frames += 1
        emitted, self._outbox = self._outbox, []
        return emitted

    def finish(self) -> list[FramePrediction]:
        """End of stream: predict what the current window still buffers. Call reset() to start again."""
        if self._switch_pending:
            self._switch_to_spare()
        self._outbox += self._receive(self.engine.finish())
        if self._ahead_from is not None:  # the stream ended before the window it was for
            self._drop_lookahead()
        emitted, self._outbox = self._outbox, []
        return emitted

    def close(self) -> None:
        """Stop the spare engine's worker thread (when there is one)."""
        if self._spare is not None:
            self._spare.close()

    def stats(self) -> dict:
        stats = self.engine.stats()
        stats.update(
            frames=self.num_frames,
            window_index=self.window_index,
            window_start=self.window_start,
            rollovers=self.rollovers,
            rollovers_ahead=self.rollovers_ahead,
            replay_frames=len(self._replay),
            lookahead=self._spare is not None,
        )
        if self._spare is not None:  # read only: the spare's worker may be stepping it
            stats["cache_bytes"] += self._spare.engine.cache_bytes
        return stats

    @property
    def on_backend_ready(self):
        """Called with the attention backend's name once the first frame sets the caches up."""
        return self.engine.on_backend_ready

    @on_backend_ready.setter
    def on_backend_ready(self, callback) -> None:
        self.engine.on_backend_ready = callback

    @property
    def on_memory_plan(self):
        """Called with the MemoryPlan (StreamConfig.gpu_memory) before the first frame is stepped."""
        return self.engine.on_memory_plan

    @on_memory_plan.setter
    def on_memory_plan(self, callback) -> None:
        self.engine.on_memory_plan = callback

    @property
    def memory_plan(self):
        """The plan made for StreamConfig.gpu_memory (None before the first frame or without a budget)."""
        return self.engine.memory_plan  # a spare engine carries the same plan

    @property
    def chunk_scales(self) -> np.ndarray:
        """[n_windows] scale of each window's transform into the first window (the reference's name)."""
        return np.array(self.window_scales)

    @property
    def chunk_transforms(self) -> np.ndarray:
        """[n_windows, 4, 4] [R | t] of each window's transform into the first window; with
        `chunk_scales` it maps x -> s R x + t (the reference's name and layout)."""
        return np.stack(self.window_transforms)

    # -- windows ---------------------------------------------------------------------------
    def _window_is_full(self) -> bool:
        if self.dynamic_windows:
            if self.engine.num_keyframes + 1 >= self.window_frames:
                # A pipelined engine may still hold the last frame's decision: the window closes
                # where the reference closes it, so make that decision now (once per window).
                self.engine.settle()
            return self.engine.num_keyframes >= self.window_frames
        return self.num_frames - self.window_start >= self.window_length

    def _roll_over(self) -> None:
        """Close the current window and open the next one on its last frames.

        In place, the new window predicts the shared frames now. With the spare holding them already,
        this call only closes the window (its last frame is emitted at once) and hands the frame being
        pushed to the spare; the spare takes over at the next call (`_switch_to_spare`), by which time
        its last shared frame is predicted too, so the pause is split between two frame intervals.
        """
        closed_start, closed_cached = self.window_start, self.engine.num_keyframes
        # The closing window's last frame may still be in flight (pipelined streaming): it belongs
        # to this window's emissions and to the tail the next window is aligned on.
        self._outbox += self._receive(self.engine.finish())
        shared = self.overlap
        if self.dynamic_windows:
            # The reference never restarts inside the closing window's scale frames.
            shared = min(shared, self.num_frames - closed_start - self.config.scale_frames)
        self._previous_tail = list(self._tail)[len(self._tail) - shared:]
        self._tail.clear()
        self._switch_pending = self._spare_holds(shared)
        if not self._switch_pending:
            self.engine.reset()
        self.window_index += 1
        self.rollovers += 1
        self.window_start = self.num_frames - shared
        self._num_shared = shared
        self._transform = None
        self._held = []
        logger.info(
            "window rollover: window %d closed after frames %d-%d (%d cached); window %d starts at frame %d "
            "and re-predicts %d frames%s",
            self.window_index - 1, closed_start, self.num_frames - 1, closed_cached, self.window_index,
            self.window_start, shared, " (predicted ahead)" if self._switch_pending else "",
        )
        if not self._switch_pending:
            self._replay_in_place()

    def _replay_in_place(self) -> None:
        """The current window's frames so far, through its engine (freshly reset)."""
        frames = list(self._replay)[len(self._replay) - (self.num_frames - self.window_start):]
        for image, timestamp in frames:
            self._outbox += self._receive(self.engine.push(image, timestamp))

    # -- the next window, ahead ------------------------------------------------------------
    def _look_ahead(self, frame: tuple[torch.Tensor, float]) -> None:
        """After frame `num_frames` went to the current window: warm a spare on the stream's first
        frames (once), and hand each frame the next window will share to the spare."""
        if self.dynamic_windows or self.lookahead is False or self._switch_pending:
            return  # (a window this short that the next lookahead would start now gets none: the spare is busy)
        index = self.num_frames
        if self._spare is None:
            warm_frames = self.config.scale_frames + 1  # the scale step and a recorded streaming step
            if index < warm_frames:
                self._warmup.append(frame)
            if index == warm_frames - 1:
                if self._wants_spare():
                    self._spare = SpareEngine(StreamingEngine(self.model, replace(self.engine.config, gpu_memory=None),
                                                              device=self.device, dtype=self.engine.dtype))
                    self._spare.engine.memory_plan = self.engine.memory_plan
                    self._spare.warm(self._warmup)
                self._warmup = []
            return
        if index == self.window_start + self.window_length - self.overlap:
            self._ahead_from = index
        if self._ahead_from is not None:
            self._spare.push(*frame)

    def _take_ahead(self) -> None:
        """While the spare is ahead: take what it has predicted so far (never waiting), and make the
        depth ratios of the shared frames both windows have predicted, so that the transform at the
        rollover has little left to do."""
        if self._ahead_from is None:
            return
        self._ahead_ready += self._spare.take_ready()
        self._make_ratios_ahead(self._ahead_from, self._tail)

    def _make_ratios_ahead(self, start: int, tail: Iterable[_AlignedFrame]) -> None:
        """FrameRatios of each frame in the spare's predictions (its window starts at stream index
        `start`) that the closing window has emitted too (`tail`), both as keyframes (the pairs)."""
        tail = {aligned.frame_index: aligned for aligned in tail}
        for raw in self._ahead_ready:
            index = start + raw.frame_index
            previous = tail.get(index)
            if index in self._early_ratios or previous is None:
                continue
            if raw.is_keyframe and previous.is_keyframe:
                self._early_ratios[index] = FrameRatios.of(previous.depth, raw.depth)

    def _spare_holds(self, shared: int) -> bool:
        """At a rollover: whether the spare took exactly the `shared` frames (if it took others, they
        are dropped)."""
        if self._ahead_from is None:
            return False
        if self._ahead_from != self.num_frames - shared:
            self._drop_lookahead()
            return False
        self._ahead_from = None
        return True

    def _drop_lookahead(self) -> None:
        """Forget what the spare took for a window that does not come as it expected."""
        self._spare.discard()
        self._ahead_from = None
        self._ahead_ready, self._early_ratios = [], {}

    def _switch_to_spare(self) -> None:
        """The second half of a rollover beside the stream: the spare's predictions of the new window's
        frames so far, and its engine as the current one. If the spare failed, the rollover happens in
        place instead, and later ones too."""
        self._switch_pending = False
        try:
            # The spare's last frames are still on the GPU: make each one's ratios while waiting for the next.
            while (taken := self._spare.take_next()) is not None:
                self._ahead_ready += taken
                self._make_ratios_ahead(self.window_start, self._previous_tail)
            predictions, self._ahead_ready = self._ahead_ready + self._spare.collect(), []
        except Exception as error:  # e.g. out of memory on the worker: go on without a spare
            logger.warning("the next window's lookahead failed (%s: %s); rollovers now pause the stream",
                           type(error).__name__, error)
            self._spare.close()
            self._spare = None
            self.lookahead = False
            self._ahead_ready, self._early_ratios = [], {}
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.engine.reset()
            self._replay_in_place()
            return
        self.engine = self._spare.swap(self.engine)
        self.rollovers_ahead += 1
        self._outbox += self._receive(predictions)

    def _wants_spare(self) -> bool:
        """Whether to run a spare engine: as asked, or (auto) on CUDA, with steps replayed as graphs,
        when a second engine fits beside the first (in the budget, or in the free device memory)."""
        if self.lookahead is not None or self.device.type != "cuda":
            return bool(self.lookahead)
        engine = self.engine
        if not engine.runner.records:  # steps launched op by op: a spare would contend for the interpreter
            logger.info("next window ahead of rollovers: off (steps are not replayed as CUDA graphs)")
            return False
        estimate = estimate_memory(self.model, engine.config, engine.image_size)
        needed = estimate.another_engine
        if engine.config.gpu_memory is not None:
            room = engine.config.gpu_memory - engine.memory_plan.estimate.total
        else:  # free on the device, and what the allocator holds unused; minus a margin for the rest
            free, _ = torch.cuda.mem_get_info(self.device)
            unused = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            room = free + unused - estimate.workspace
        fits = needed <= room
        logger.info("next window ahead of rollovers: %s (a second engine's cache, graphs and activations: %s; "
                    "room %s)",
                    "on" if fits else "off, rollovers pause the stream", gib(needed), gib(max(room, 0)))
        return fits

    def _receive(self, raw_predictions: list[FramePrediction]) -> list[FramePrediction]:
        """Window-local predictions in stream order -> emissions in the first window's frame."""
        for raw in raw_predictions:
            self._held.append(replace(raw, frame_index=self.window_start + raw.frame_index,
                                      window_index=self.window_index))
        if self._transform is None:
            if len(self._held) < self._num_shared:
                return []
            self._transform = self._estimate_transform(self._held[: self._num_shared])
        emitted = self._align(self._held)
        self._held = []
        return emitted

    def _estimate_transform(self, shared: list[FramePrediction]) -> Sim3:
        previous = self._previous_tail
        assert [p.frame_index for p in previous] == [s.frame_index for s in shared]
        ratios = {k: self._early_ratios[s.frame_index] for k, s in enumerate(shared)
                  if s.frame_index in self._early_ratios}
        transform = estimate_window_alignment(
            np.stack([p.pose_enc for p in previous]), [p.depth for p in previous],
            np.array([p.is_keyframe for p in previous]),
            np.stack([s.pose_enc for s in shared]), [s.depth for s in shared],
            np.array([s.is_keyframe for s in shared]), ratios,
        )
        self._early_ratios = {}
        self.window_scales.append(transform.scale)
        self.window_transforms.append(transform.matrix)
        angle = np.degrees(np.arccos(np.clip((np.trace(transform.rotation) - 1) / 2, -1, 1)))
        logger.info("window %d aligned on %d shared frames: scale %.6f, rotation %.2f deg, translation %s",
                    self.window_index, len(shared), transform.scale, angle, np.round(transform.translation, 4))
        return transform

    def _align(self, raws: list[FramePrediction]) -> list[FramePrediction]:
        """Map raw predictions into the first window's frame. The first window's predictions pass
        unchanged (their pose_enc is the model's own); later windows' cameras are moved by the
        window's Sim(3), their quaternions keeping the model's norm (Sim3.apply_to_pose_enc). All at
        once: a rollover aligns ~17 frames while the stream waits."""
        transform = self._transform
        aligned = raws
        if raws and not transform.is_identity:
            pose_enc = transform.apply_to_pose_enc(np.stack([raw.pose_enc for raw in raws]).astype(np.float64))
            pose_enc = pose_enc.astype(np.float32)
            height, width = raws[0].image_size  # one stream, one frame size
            c2w, intrinsics = decode_pose(torch.from_numpy(pose_enc), height, width)
            c2w, intrinsics, scale = c2w.numpy(), intrinsics.numpy(), np.float32(transform.scale)
            aligned = [replace(raw, pose_enc=pose_enc[k], c2w=c2w[k], intrinsics=intrinsics[k], depth=raw.depth * scale)
                       for k, raw in enumerate(raws)]
        self._tail.extend(_AlignedFrame(a.frame_index, a.pose_enc, a.depth, a.is_keyframe) for a in aligned)
        return aligned
