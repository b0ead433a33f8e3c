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
With the lookahead (a spare engine that predicts the new window beside the stream,
models/lookahead.py), the stream does not wait: until the spare has caught up, the closed window
predicts each new frame once more without caching it and emits it (`provisional`), and the spare's
predictions follow a few pushes later, the same final emissions in the same order as in place.
The last emission of every frame_index is the reference's stitched result: the shared frames come
from the later window.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import numpy as np
import torch

from .engine import StreamConfig, StreamingEngine
from .gct import GCTStream
from .lookahead import SpareEngine
from .memory import estimate_memory, gib
from .pose import decode_pose
from .prediction import FramePrediction
from .similarity import FrameRatios, Sim3, estimate_chunk_alignment

logger = logging.getLogger("stream_recon.models.windowed")

TRAINED_VIEWS = 320  # views per sequence the released checkpoints were trained with
# While the spare has work for the next window, a push of the stream lasts up to PACE times its usual
# push: the spare has the device alone for the rest (docs/PERFORMANCE.md, tenth session).
PACE = 1.6
# The stream's CUDA stream, once there is a spare (whose stream has the default priority, 0): lower
# numbers are more urgent.
MAIN_STREAM_PRIORITY = -1
# The most frames a closed window predicts provisionally while the next one catches up; then the
# stream waits for the spare.
MAX_PROVISIONAL = 48


# -- the engine --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _AlignedFrame:
    """What a later window needs of a frame to align itself: its final pose and depth."""

    frame_index: int
    pose_enc: np.ndarray  # [9]
    depth: np.ndarray  # [H, W]
    is_keyframe: bool


@dataclass(frozen=True)
class _ClosedWindow:
    """A window after its rollover, while the next one catches up on the spare: it still predicts the
    new frames (uncached, in its own world frame) so that the stream need not wait."""

    start: int  # stream index of its first frame
    index: int
    transform: Sim3


class WindowedEngine:
    """A StreamingEngine that rolls over to a new window before the cache outgrows the model.

    A window holds up to `window_frames` cached frames (scale frames + keyframes): with
    `keyframes="interval:K"` it spans scale + (window_frames - scale) * K input frames; with
    `"flow"` it closes after its (window_frames - scale)-th keyframe. The next window starts
    `overlap` input frames back, which are kept in a ring (never the stream).
    Same interface as StreamingEngine; predictions carry `window_index`, and a frame predicted by
    two windows is emitted twice (the later emission is final).

    `lookahead`: predict the next window on a spare engine beside the stream (models/lookahead.py),
    so that a rollover does not stop it. None: where it helps and fits (a CUDA device, steps replayed
    as graphs, room for a second engine); True: also elsewhere (no gain on a CPU; for tests); False:
    never. With the spare, the stream goes on through a rollover: until the spare has caught up, the
    closed window predicts each new frame once more without caching it (`provisional` emissions) and
    the new window emits it again a few pushes later. The last emission of every frame, and the order
    of the final ones, are the same either way.
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
        self.lookahead = lookahead
        self._spare: SpareEngine | None = None
        self._main_stream: torch.cuda.Stream | None = None  # the stream's device work, once there is a spare
        self._warmup: list[tuple[torch.Tensor, float]] = []  # the first frames, to warm a spare on
        # Frames a closed window may predict while the next catches up. Its cache has room for one
        # uncached frame unless the window spans the model's whole temporal range; and the new window
        # must not be able to fill up before it takes over (overlap + these + 1 frames < window_frames).
        room = window_frames - overlap - 1 if window_frames < model.config.max_frames else 0
        self._provisional_room = max(0, min(MAX_PROVISIONAL, room))
        # The shared frames and the one a rollover hands the spare (with a spare: and those it may be
        # behind, so that a failed spare can be replaced by a rollover in place).
        self._replay: deque[tuple[torch.Tensor, float]] = deque(maxlen=overlap + 1)
        self._tail: deque[_AlignedFrame] = deque(maxlen=overlap)
        self._push_seconds: deque[float] = deque(maxlen=32)  # the stream's own pushes, for pacing
        self.reset()

    # -- public ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new stream: window 0, empty caches, no transforms."""
        self.engine.reset()
        if self._spare is not None:
            self._spare.discard()
        self._ahead_from: int | None = None  # the stream index from which the spare takes frames
        # A window closed beside the spare, which holds the next one: the closed window until the spare
        # takes over, and whether the closed window still predicts new frames (the spare is behind).
        self._closed: _ClosedWindow | None = None
        self._catching_up = False
        self._provisional_count = 0  # frames the closed window predicted since its rollover
        self._ahead_ready: list[FramePrediction] = []  # the spare's predictions, taken before they are received
        self._early_ratios: dict[int, FrameRatios] = {}  # frame index -> its ratios, for the next transform
        self.num_frames = 0
        self.window_index = 0
        self.window_start = 0  # stream index of the current window's first frame
        self.rollovers = 0
        self.rollovers_ahead = 0  # of them, those whose new window the spare predicted
        self.provisional_frames = 0  # frames predicted by a closed window while the next caught up
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
        started = time.perf_counter()
        timestamp = float(self.num_frames) if timestamp is None else float(timestamp)
        self.engine.check_frame(image)  # a bad frame is refused before it changes anything
        frame = (torch.as_tensor(image).detach().clone(), timestamp)
        with self._on_main_stream():
            if self._switch_pending:
                self._switch_to_spare()
            if self._window_is_full():
                self._roll_over()
            if self._catching_up:
                self._push_beside_spare(frame)
            elif self._switch_pending:  # the spare is a frame behind at most: it takes this one alone
                self._spare.push(*frame)
            else:
                self._outbox += self._receive(self.engine.push(image, timestamp))
            self._replay.append(frame)
            self._look_ahead(frame)
            self._take_ahead()
            self.num_frames += 1
            self._pace(started)
        emitted, self._outbox = self._outbox, []
        return emitted

    def finish(self) -> list[FramePrediction]:
        """End of stream: predict what the current window still buffers. Call reset() to start again."""
        with self._on_main_stream():
            if self._catching_up:
                self._stop_provisional()
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
            provisional_frames=self.provisional_frames,
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
    @property
    def _switch_pending(self) -> bool:
        """The spare, holding the new window and a frame behind at most, takes over at the next call."""
        return self._closed is not None and not self._catching_up

    def _window_is_full(self) -> bool:
        if self._catching_up:  # the closed window is; the next (on the spare) cannot be yet
            return False
        if self.dynamic_windows:
            if self.engine.num_keyframes + 1 >= self.window_frames:
                # A pipelined engine may still hold the last frame's decision: the window closes
                # where the reference closes it, so make that decision now (once per window).
                self.engine.settle()
            return self.engine.num_keyframes >= self.window_frames
        return self.num_frames - self.window_start >= self.window_length

    def _roll_over(self) -> None:
        """Close the current window and open the next one on its last frames.

        In place, the new window predicts the shared frames now. With a spare, the spare holds them
        (taken ahead, or handed over now), the closed window predicts this frame provisionally, and
        the spare takes over once it has caught up (`_push_beside_spare`).
        """
        closed_cached = self.engine.num_keyframes
        # The closing window's last frame may still be in flight (pipelined streaming): it belongs
        # to this window's emissions and to the tail the next window is aligned on.
        self._outbox += self._receive(self.engine.finish())
        closed = _ClosedWindow(self.window_start, self.window_index, self._transform)
        shared = self.overlap
        if self.dynamic_windows:
            # The reference never restarts inside the closing window's scale frames.
            shared = min(shared, self.num_frames - closed.start - self.config.scale_frames)
        self._previous_tail = list(self._tail)[len(self._tail) - shared:]
        self._tail.clear()
        beside = self._spare_takes_window(shared)
        if beside:
            self._closed, self._provisional_count = closed, 0
            self._catching_up = self._provisional_room > 0  # else the spare takes over at the next call
        else:
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
            closed.index, closed.start, self.num_frames - 1, closed_cached, self.window_index,
            self.window_start, shared, " (on the spare engine)" if beside else "",
        )
        if not beside:
            self._replay_in_place()

    def _replay_in_place(self) -> None:
        """The current window's frames so far, through its engine (freshly reset)."""
        frames = list(self._replay)[len(self._replay) - (self.num_frames - self.window_start):]
        for image, timestamp in frames:
            self._outbox += self._receive(self.engine.push(image, timestamp))

    # -- the next window, on the spare -----------------------------------------------------
    def _look_ahead(self, frame: tuple[torch.Tensor, float]) -> None:
        """After frame `num_frames` went to the current window: warm a spare on the stream's first
        frames (once), and, when windows close at a known frame, hand the spare each frame the next
        window will share as it comes."""
        if self.lookahead is False or self._closed is not None:
            return  # (a window this short that the next lookahead would start now gets it at its rollover)
        index = self.num_frames
        if self._spare is None:
            warm_frames = self.config.scale_frames + 1  # the scale step and a recorded streaming step
            if index < warm_frames:
                self._warmup.append(frame)
            if index == warm_frames - 1:
                if self._wants_spare():
                    self._start_spare()
                self._warmup = []
            return
        if self.dynamic_windows:  # a flow window's end is known when it comes: the spare takes its frames then
            return
        if index == self.window_start + self.window_length - self.overlap:
            self._ahead_from = index
        if self._ahead_from is not None:
            self._spare.push(*frame)

    def _start_spare(self) -> None:
        self._spare = SpareEngine(StreamingEngine(self.model, replace(self.engine.config, gpu_memory=None),
                                                  device=self.device, dtype=self.engine.dtype))
        self._spare.engine.memory_plan = self.engine.memory_plan
        self._spare.warm(self._warmup)
        if self.device.type == "cuda":
            self._main_stream = torch.cuda.Stream(self.device, priority=MAIN_STREAM_PRIORITY)
        self._replay = deque(self._replay, maxlen=self.overlap + 1 + self._provisional_room)

    def _spare_takes_window(self, shared: int) -> bool:
        """At a rollover: whether the spare holds the new window's `shared` frames, taken ahead or
        handed over now (frames it took for another window are dropped first)."""
        if self._spare is None:
            return False
        if self._ahead_from is not None and self._ahead_from == self.num_frames - shared:
            self._ahead_from = None
            return True
        if self._ahead_from is not None:
            self._drop_lookahead()
        for image, timestamp in list(self._replay)[len(self._replay) - shared:]:
            self._spare.push(image, timestamp)
        return True

    def _push_beside_spare(self, frame: tuple[torch.Tensor, float]) -> None:
        """After a rollover, while the spare catches up: it takes the frame, and the closed window
        predicts it now, uncached, so the stream need not wait. Once the spare is a frame behind (or
        the closed window may go on no longer) it takes the frames alone, and over at the next push."""
        if self._provisional_count and (self._spare.backlog <= 1
                                        or self._provisional_count >= self._provisional_room):
            self._stop_provisional()
            self._spare.push(*frame)
            return
        self._spare.push(*frame)
        self._outbox += self._provisional(self.engine.push(*frame, cached=False))
        self._provisional_count += 1
        self.provisional_frames += 1

    def _stop_provisional(self) -> None:
        """The closed window's last provisional prediction, and the spare takes over at the next push."""
        self._outbox += self._provisional(self.engine.finish())
        self._catching_up = False

    def _provisional(self, raws: list[FramePrediction]) -> list[FramePrediction]:
        """The closed window's uncached predictions, in the first window's frame like its own."""
        closed = self._closed
        return self._aligned([replace(raw, frame_index=closed.start + raw.frame_index, window_index=closed.index,
                                      provisional=True) for raw in raws], closed.transform)

    def _take_ahead(self) -> None:
        """Take what the spare has predicted so far (never waiting). Before the rollover: keep it (its
        depth ratios are made while the stream is paced). After it (from the push after the one that
        closed the window): receive it, once the transform's ratios are made."""
        if self._ahead_from is not None:
            self._ahead_ready += self._spare.take_ready()
        elif self._closed is not None and self.num_frames > self.window_start + self._num_shared:
            self._ahead_ready += self._spare.take_ready()
            if self._transform is None:
                if len(self._ahead_ready) < self._num_shared or self._make_ratios(*self._ratios_to_make(), limit=0):
                    return  # the transform waits for its ratios, made while the stream is paced
            taken, self._ahead_ready = self._ahead_ready, []
            self._outbox += self._receive(taken)

    def _ratios_to_make(self) -> tuple[list[FramePrediction], int, Iterable[_AlignedFrame]] | None:
        """The spare's predictions whose depth ratios the next transform needs, the stream index of their
        window's first frame and the frames they pair with; None when no transform waits for any."""
        if self._ahead_from is not None:
            return self._ahead_ready, self._ahead_from, self._tail
        if self._closed is not None and self._transform is None:
            return self._ahead_ready, self.window_start, self._previous_tail
        return None

    def _make_ratios(self, raws: list[FramePrediction], start: int, tail: Iterable[_AlignedFrame],
                     limit: int | None = None) -> int:
        """FrameRatios of each of the spare's predictions `raws` (its window starts at stream index
        `start`) that the closing window has emitted too (`tail`), both as keyframes (the pairs); at most
        `limit` new ones. Returns how many pairs in `raws` are still without."""
        tail = {aligned.frame_index: aligned for aligned in tail}
        missing = 0
        for raw in raws:
            index = start + raw.frame_index
            previous = tail.get(index)
            if index in self._early_ratios or previous is None or not (raw.is_keyframe and previous.is_keyframe):
                continue
            if limit is not None and limit <= 0:
                missing += 1
                continue
            self._early_ratios[index] = FrameRatios.of(previous.depth, raw.depth)
            limit = None if limit is None else limit - 1
        return missing

    def _drop_lookahead(self) -> None:
        """Forget what the spare took for a window that does not come as it expected."""
        self._spare.discard()
        self._ahead_from = None
        self._ahead_ready, self._early_ratios = [], {}

    def _switch_to_spare(self) -> None:
        """The spare's predictions of the new window so far, and its engine as the current one. If the
        spare failed, the rollover happens in place instead, and later ones too."""
        self._closed = None
        try:
            # The spare's last frames are still on the GPU: make the ratios left while waiting for the next.
            while (taken := self._spare.take_next()) is not None:
                self._ahead_ready += taken
                if self._transform is None:
                    self._make_ratios(self._ahead_ready, self.window_start, self._previous_tail)
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
            self._forget_alignment()
            self.engine.reset()
            self._replay_in_place()
            return
        self.engine = self._spare.swap(self.engine)
        self.rollovers_ahead += 1
        self._outbox += self._receive(predictions)

    def _forget_alignment(self) -> None:
        """The current window as if none of its frames were received (its frames are predicted again)."""
        if self._transform is not None:
            self.window_scales.pop()
            self.window_transforms.pop()
        self._transform, self._held = None, []
        self._tail.clear()

    def _pace(self, started: float) -> None:
        """While the spare has work for the next window, hold the stream until PACE times its usual
        push has passed since this one `started` (or the spare is done): the spare then has the
        device alone for a while after each frame, and the stream's thread makes the depth ratios the
        next transform needs meanwhile. Otherwise, note how long the push took."""
        elapsed = time.perf_counter() - started
        if self._ahead_from is None and self._closed is None:
            self._push_seconds.append(elapsed)
        elif self._push_seconds:
            deadline = started + PACE * float(np.median(self._push_seconds))
            to_make = self._ratios_to_make()  # host work that waits for the transform, done in the meantime
            while to_make is not None and time.perf_counter() < deadline and self._make_ratios(*to_make, limit=1):
                pass
            self._spare.wait_until(deadline)

    @contextlib.contextmanager
    def _on_main_stream(self) -> Iterator[None]:
        """The stream's device work, once there is a spare, on a CUDA stream of higher priority than
        the spare's: the spare gets what the stream leaves of the GPU instead of slowing it down."""
        stream = self._main_stream
        if stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        stream.wait_stream(caller)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            caller.wait_stream(stream)

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
        emitted = self._aligned(self._held, self._transform)
        self._held = []
        self._tail.extend(_AlignedFrame(a.frame_index, a.pose_enc, a.depth, a.is_keyframe) for a in emitted)
        return emitted

    def _estimate_transform(self, shared: list[FramePrediction]) -> Sim3:
        previous = self._previous_tail
        assert [p.frame_index for p in previous] == [s.frame_index for s in shared]
        ratios = {k: self._early_ratios[s.frame_index] for k, s in enumerate(shared)
                  if s.frame_index in self._early_ratios}
        transform = estimate_chunk_alignment(
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

    @staticmethod
    def _aligned(raws: list[FramePrediction], transform: Sim3) -> list[FramePrediction]:
        """Raw predictions mapped into the first window's frame. The first window's predictions pass
        unchanged (their pose_enc is the model's own); later windows' cameras are moved by the
        window's Sim(3), their quaternions keeping the model's norm (Sim3.apply_to_pose_enc). All at
        once: a rollover aligns ~17 frames in one push."""
        if not raws or transform.is_identity:
            return raws
        pose_enc = transform.apply_to_pose_enc(np.stack([raw.pose_enc for raw in raws]).astype(np.float64))
        pose_enc = pose_enc.astype(np.float32)
        height, width = raws[0].image_size  # one stream, one frame size
        c2w, intrinsics = decode_pose(torch.from_numpy(pose_enc), height, width)
        c2w, intrinsics, scale = c2w.numpy(), intrinsics.numpy(), np.float32(transform.scale)
        return [replace(raw, pose_enc=pose_enc[k], c2w=c2w[k], intrinsics=intrinsics[k], depth=raw.depth * scale)
                for k, raw in enumerate(raws)]
