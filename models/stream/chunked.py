"""Chunked streaming for streams of unknown length (spec MODEL.md §14).

The model was trained on up to 320 views and its temporal RoPE table stops at 1024 positions, so an
unbounded stream is cut into chunks, each an independent stream with a fresh cache (models/stream/chunks.py
says how their predictions land in one world frame).

Chunks and emissions for 14 frames, scale_frames=3, chunk_frames=6, overlap=3, keyframes all::

    frame      0  1  2  3  4  5  6  7  8  9 10 11 12 13
    chunk 0    S  S  S  K  K  K
    chunk 1             S  S  S  K  K  K
    chunk 2                      S  S  S  K  K  K
    chunk 3                               S  S  S  K  K

Every frame is emitted when it is first predicted, already in chunk 0's frame. A chunk n > 0 holds
back its predictions of the shared frames until it has predicted all of them (its transform needs
them); with overlap >= scale_frames that happens inside the `push` of the frame that opened the
chunk, which then returns the re-predicted shared frames followed by the new one. With a spare
engine (models/stream/rollover.py), the stream does not wait: until the spare has caught up, the closed
chunk predicts each new frame once more without caching it and emits it (`provisional`), and the
spare's predictions follow a few pushes later, the same final emissions in the same order as in
place. The last emission of every frame_index is the reference's stitched result: the shared frames
come from the later chunk.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import replace

import numpy as np
import torch

from ..network.gct import GCTStream
from ..supervision import Deadline, Helper
from .chunks import ChunkAlignment, ChunkLink, check_chunking
from .engine import StreamingEngine
from .frames import checked_frame
from .lookahead import SpareEngine, SpareLimits
from .memory import cache_pages
from .prediction import FramePrediction
from .rollover import (
    MAX_PROVISIONAL,
    MAX_PROVISIONAL_AHEAD,
    MainStream,
    Phase,
    Rollover,
)
from .spare_room import provisional_room_beside
from .stream_config import TRAINED_VIEWS, StreamConfig

logger = logging.getLogger("stream_recon.models.stream.chunked")

# A flow chunk's spare starts before the rollover, where the chunk would close if every frame from then
# on were a keyframe, once at least DENSE_KEYFRAMES of the last KEYFRAME_RATE_FRAMES frames were. Started
# at the rollover, the spare of a video with 964 keyframes in 1,000 frames never catches up at 1.6x
# pacing: the stream stops 92-174 ms at rollovers; with 344 keyframes it
# catches up (50 ms). A guess made 16 frames ahead holds only if those frames all are keyframes; each
# miss drops what the spare took (on its worker: the stream does not wait) and it takes the frames from
# the new start again, out of the replay; the last start before the rollover is then a frame or a few
# before it, where at the rollover the spare would have all 16 shared frames still to take.
DENSE_KEYFRAMES = 0.8
KEYFRAME_RATE_FRAMES = 32


def chunk_stream_config(config: StreamConfig, chunk_frames: int, model_max_frames: int) -> StreamConfig:
    """The settings of each chunk's engine. A chunk's cache holds its cached frames and one pending
    frame: its page pool holds their special tokens (not the model's whole temporal range), which the
    memory plan counts."""
    closes_at = chunk_frames if config.policy.closes_on_keyframes else None
    return replace(config, max_cached_frames=min(chunk_frames + 1, model_max_frames), closes_at_cached_frames=closes_at)


class ChunkedEngine:
    """A StreamingEngine that rolls over to a new chunk before the cache outgrows the model.

    A chunk holds up to `chunk_frames` cached frames (scale frames + keyframes): with a policy whose
    cached frame stands for K input frames (`keyframes="interval:K"`) it spans scale + (chunk_frames -
    scale) * K input frames; with one that closes on keyframes (`"flow"`) it closes after its
    (chunk_frames - scale)-th keyframe. The next chunk starts
    `overlap` input frames back, which are kept in a ring (never the stream).
    Same interface as StreamingEngine; predictions carry `chunk_index`, and a frame predicted by
    two chunks is emitted twice (the later emission is final).

    `lookahead`: predict the next chunk on a spare engine beside the stream (models/stream/rollover.py),
    so that a rollover does not stop it. None: where it helps and fits (a CUDA device, steps replayed
    as graphs, room for a second engine); True: also elsewhere (no gain on a CPU; for tests); False:
    never. The last emission of every frame, and the order of the final ones, are the same either way.
    """

    def __init__(self, model: GCTStream, config: StreamConfig | None = None, *, chunk_frames: int = TRAINED_VIEWS,
                 overlap: int = 16, device: str | torch.device | None = None, dtype: torch.dtype | None = None,
                 lookahead: bool | None = None, spare_limits: SpareLimits | None = None):
        """`spare_limits`: how long the stream waits for a spare engine and for its warm-up
        (models/stream/lookahead.py; None: SpareLimits())."""
        self.config = config or StreamConfig()
        check_chunking(chunk_frames, overlap, self.config.scale_frames, model.config.max_frames)
        self.chunk_frames = chunk_frames
        self.overlap = overlap
        policy = self.config.policy
        self.closes_on_keyframes = policy.closes_on_keyframes  # a chunk's end is known only when it comes
        # Input frames per chunk when keyframes follow a fixed rule (unused where chunks close on keyframes).
        per_cached = policy.input_frames_per_cached_frame or 1
        self.chunk_length = self.config.scale_frames + (chunk_frames - self.config.scale_frames) * per_cached
        self._chunk_config = chunk_stream_config(self.config, chunk_frames, model.config.max_frames)
        self.engine = StreamingEngine(model, self._chunk_config, device=device, dtype=dtype)
        self._eager_steps = self.engine.eager_steps  # `steps_eagerly`'s choice for its engines
        self._frame_size: tuple[int, int] | None = None  # the stream's (height, width), from its first frame
        self.model, self.device = self.engine.model, self.engine.device
        self.lookahead = lookahead
        self.spare_limits = spare_limits or SpareLimits()
        self._spare_image: torch.Tensor | None = None  # the frame its spare warmed up on
        # Where a spare may run, the current engine runs on a stream of its own from the warm-up on.
        self._main_stream = MainStream(self.device) if self.device.type == "cuda" and lookahead is not False else None
        self._rollover: Rollover | None = None  # the spare engine and the rollover's phases, once started
        self.spare_off: str | None = None  # why a spare started for the stream went, for good
        self._spare_helper: Helper | None = None  # the last spare's, kept after the spare went (run.json)
        self._first_frame: torch.Tensor | None = None  # the stream's, to warm a spare on
        self._spare_wanted: bool | None = None  # decided before the first frame (`_decide_spare`)
        # Frames a closed chunk may predict while the next catches up. Its cache has room for one
        # uncached frame unless the chunk spans the model's whole temporal range; and the new chunk
        # must not be able to fill up before it takes over (overlap + these + 1 frames < chunk_frames).
        room = chunk_frames - overlap - 1 if chunk_frames < model.config.max_frames else 0
        most = MAX_PROVISIONAL if self.closes_on_keyframes else MAX_PROVISIONAL_AHEAD
        self._provisional_room = max(0, min(most, room))
        # The shared frames and the one a rollover hands the spare (with a spare: and those it may be
        # behind, so that a failed spare can be replaced by a rollover in place).
        self._replay: deque[tuple[torch.Tensor, float]] = deque(maxlen=overlap + 1)
        self.alignment = ChunkAlignment(overlap)
        # The current chunk's keyframe count after each of the last pushes (flow: how dense keyframes are).
        self._keyframe_counts: deque[int] = deque(maxlen=KEYFRAME_RATE_FRAMES + 1)
        self.reset()

    # -- public ----------------------------------------------------------------------------
    def reset(self) -> None:
        """Start a new stream: chunk 0, empty caches, no transforms."""
        self.engine.reset()
        if self._rollover is not None:
            try:
                self._rollover.reset()
            except Exception as error:  # raised or stalled on its worker: the next stream goes on without it
                self._turn_spare_off(error)
        self.alignment.reset()
        self.num_frames = 0
        self.rollovers = 0
        self.rollovers_ahead = 0  # of them, those whose next chunk the spare predicted
        self.provisional_frames = 0  # frames predicted by a closed chunk while the next caught up
        self._outbox: list[FramePrediction] = []  # computed but not yet returned (a push that raised)
        self._final_through = -1  # the latest frame emitted final
        self._replay.clear()
        self._keyframe_counts.clear()

    def push(self, image: torch.Tensor | np.ndarray, timestamp: float | None = None) -> list[FramePrediction]:
        """Add frame [3, H, W]; returns the predictions emitted by it, oldest chunk first."""
        started = time.perf_counter()
        timestamp = float(self.num_frames) if timestamp is None else float(timestamp)
        # Checked once, here: a bad frame is refused before it changes anything, and every engine it
        # goes to takes it as checked (StreamingEngine.push_checked; an engine's first frame sets it up).
        checked = checked_frame(image, self.model.config.patch_size, self._frame_size, self.num_frames)
        self._frame_size = tuple(checked.shape[1:])
        self._decide_spare(self._frame_size)
        frame = (checked.detach().clone(), timestamp)
        with self._on_main_stream():
            if self._rollover is not None:
                self._spare_steps_as_chosen()
            if self._phase is Phase.SWITCH_PENDING:
                self._switch_to_spare()
            in_place = self._chunk_is_full() and self._roll_over(frame)
            # The frame to whichever engine takes it in this phase; a streaming frame of the current chunk,
            # the common case, straight to its engine (docs/ARCHITECTURE.md, "One frame's path").
            phase = self._phase
            if in_place:  # the new chunk's engine took it after the shared frames (_roll_over)
                pass
            elif phase is Phase.CATCHING_UP:
                self._outbox += self._rollover.push_beside(self.engine, frame)
                self.provisional_frames += self._phase is Phase.CATCHING_UP  # (else it went to the spare alone)
            elif phase is Phase.SWITCH_PENDING:  # the spare is a frame behind at most: it takes this one alone
                self._rollover.push_last(frame)
            elif self.engine.num_frames == 0:  # a scale frame: the scale step runs once its frames are in
                self._outbox += self.alignment.receive(self._push_scale_frame(frame))
            else:
                self._outbox += self.alignment.receive(self.engine.push_checked(*frame))
            self._replay.append(frame)
            self._look_ahead(frame)
            if self._rollover is not None:
                self._outbox += self._rollover.take_ready(self.num_frames)
            self.num_frames += 1
        # Paced last, after the main stream's join: whatever the push spends counts toward the held time
        # instead of adding to it (a join can wait 8 ms there for the driver).
        if self._rollover is not None:
            self._rollover.pace(started)
        return self._take_outbox()

    def finish(self) -> list[FramePrediction]:
        """End of stream: predict what the current chunk still buffers (every part of `finish_in_parts`,
        in order). Call reset() to start again."""
        return [prediction for part in self.finish_in_parts() for prediction in part]

    def finish_in_parts(self) -> Iterator[list[FramePrediction]]:
        """`finish`, a part as soon as it is ready: a stream that ends while the next chunk catches up
        gets the closed chunk's last provisional frame first, and the next chunk's frames once the spare
        has caught up. Ended in one part, the last frame waits for the spare's backlog: 85 ms after the
        frame before (2.8x the median interval) at the end of a keyframe-dense flow run.
        A part may be empty; a consumer that stops early leaves the rest to reset()."""
        with self._on_main_stream():
            if self._phase is Phase.CATCHING_UP:
                self._outbox += self._rollover.stop_provisional(self.engine)
        yield self._take_outbox()
        with self._on_main_stream():
            if self._phase is Phase.SWITCH_PENDING:
                self._switch_to_spare()
            self._outbox += self.alignment.receive(self.engine.finish())
            if self._phase is Phase.AHEAD:  # the stream ended before the chunk it was for
                self._rollover.drop_ahead()
        yield self._take_outbox()

    def _take_outbox(self) -> list[FramePrediction]:
        """What is computed and not yet returned, less the provisional predictions of frames emitted
        final by now or in the same list: the spare can predict a frame while the closed chunk does
        (or before, where the closed chunk emits a push late), and a provisional emission then is stale
        on arrival. A consumer never sees a frame go from final back to provisional."""
        finals = [prediction.frame_index for prediction in self._outbox if not prediction.provisional]
        self._final_through = max([self._final_through, *finals])
        emitted = [prediction for prediction in self._outbox
                   if not (prediction.provisional and prediction.frame_index <= self._final_through)]
        self._outbox = []
        return emitted

    def warm_up(self, image: torch.Tensor | np.ndarray, *,
                dry_pass: Callable[[torch.device], AbstractContextManager[dict]] | None = None) -> dict[str, float]:
        """Before the stream's first frame: warm the engine on copies of `image`, that first frame
        (StreamingEngine.warm_up, its steps first run dry where the builder gives a `dry_pass`), then start
        the spare engine where one is wanted and wait while it warms on its worker, so that neither compiles
        nor records once the stream runs. Returns the seconds by part ("spare_s" for the spare's)."""
        if self.num_frames:
            raise ValueError("an engine warms up before its stream's first frame, not during a stream")
        image = checked_frame(image, self.model.config.patch_size, self._frame_size, 0)
        self._decide_spare(tuple(image.shape[1:]))
        with self._on_main_stream():
            seconds = self.engine.warm_up(image, dry_pass=dry_pass)
        self._frame_size = self.engine.image_size
        if not self._spare_wanted or self._rollover is not None:
            return seconds
        started = time.perf_counter()
        self._start_spare(image)
        if not self._spare_warmed():
            self._drop_spare()  # (outside the error's handler: its traceback holds the spare's tensors)
        seconds["spare_s"] = round(time.perf_counter() - started, 3)
        return seconds

    @property
    def steps_config(self) -> StreamConfig:
        """The settings its engines' steps run under (a chunk's: its cache sized for the chunk)."""
        return self.engine.config

    @property
    def eager_steps(self) -> bool:
        """StreamingEngine.eager_steps, as `steps_eagerly` chose for its engines (remembered: read every push)."""
        return self._eager_steps

    def steps_eagerly(self, eager: bool) -> None:
        """StreamingEngine.steps_eagerly for the current engine now, and for the spare on its worker after
        the frames queued there (one started later starts so)."""
        self._eager_steps = eager
        self.engine.steps_eagerly(eager)
        self._spare_steps_as_chosen()

    def _spare_steps_as_chosen(self) -> None:
        """The spare's steps as `steps_eagerly` chose, once its worker is idle (no job queued or running:
        only this thread queues them) and the current engine has recorded its own step again (two graphs are
        never captured at once); until then it goes on as it was."""
        spare = None if self._rollover is None else self._rollover.spare
        if spare is None or spare.eager_steps == self._eager_steps or spare.backlog:
            return
        if self.engine.runner is not None and self.engine.runner.records_next:
            return
        spare.steps_eagerly(self._eager_steps)
        if spare.engine.at_stream_start and self._spare_image is not None:
            # its graph recorded again now, on its worker beside the stream, not at the next rollover
            spare.warm(self._spare_image)

    @property
    def slow_first_step(self) -> bool:
        """StreamingEngine.slow_first_step: whether `warm_up` saves the stream a wait."""
        return self.engine.slow_first_step

    def close(self) -> None:
        """Stop the spare engine's worker thread (when there is one)."""
        if self._rollover is not None:
            self._rollover.close()

    def helpers(self) -> dict[str, Helper]:
        """The engine's helpers that ran, by run.json's name: the spare engine, where one started."""
        return {} if self._spare_helper is None else {"spare_engine": self._spare_helper}

    def stats(self) -> dict:
        stats = self.engine.stats()
        stats.update(
            frames=self.num_frames,
            chunk_index=self.alignment.index,
            chunk_start=self.alignment.start,
            rollovers=self.rollovers,
            rollovers_ahead=self.rollovers_ahead,
            lookahead_starts=self._rollover.ahead_starts if self._rollover is not None else 0,
            spare_warm_up_s=None if self._rollover is None or self._rollover.spare.warm_seconds is None
            else round(self._rollover.spare.warm_seconds, 3),
            provisional_frames=self.provisional_frames,
            replay_frames=len(self._replay),
            lookahead=self._rollover is not None,
            spare_off=self.spare_off,
            rollover_phase=self._phase.value,
        )
        if self._rollover is not None:  # read only: the spare's worker may be stepping it
            stats["cache_bytes"] += self._rollover.spare.engine.cache_bytes
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
    def stream_config(self) -> StreamConfig:
        """The StreamConfig each chunk's engine runs with: `config` with the cache sized for one chunk
        (max_cached_frames), which is what a memory plan for this stream must be made from."""
        # kept, not read from self.engine, whose config has the plan applied once the first frame came
        return self._chunk_config

    def plan_memory_for(self, image_size: tuple[int, int]):
        """The memory plan the first frame will use if it is image_size (height, width), made now
        (StreamingEngine.plan_memory_for): MemoryBudgetError when nothing fits, None without a budget."""
        return self.engine.plan_memory_for(image_size)

    @property
    def memory_plan(self):
        """The plan made for StreamConfig.gpu_memory (None before the first frame or without a budget)."""
        return self.engine.memory_plan

    @property
    def chunk_links(self) -> list[ChunkLink]:
        """How each chunk after the first was hung on the one before (the odometry of a pose graph)."""
        return list(self.alignment.links)

    # -- chunks ----------------------------------------------------------------------------
    @property
    def _phase(self) -> Phase:
        return Phase.STEADY if self._rollover is None else self._rollover.phase

    def _push_scale_frame(self, frame: tuple[torch.Tensor, float]) -> list[FramePrediction]:
        """The current engine's push of a scale frame; the last one runs the scale step. Out of device memory
        in that step (the stream's one eager step, after the warm-up started a spare beside it, as on a 16 GB
        card at 518x392 with an earlier room rule), the spare goes and the step runs again: the stream
        goes on as without a spare, its rollovers pausing it."""
        try:
            predictions = self.engine.push_checked(*frame)
        except torch.OutOfMemoryError:
            if self._rollover is None or self.engine.num_frames > 0:
                raise
            logger.warning("out of device memory in the stream's first step beside the next chunk's spare: the "
                           "spare goes, rollovers now pause the stream (--gpu-memory plans a run to fit a GPU)")
            self.spare_off = "out of device memory in the stream's first step beside it"
        else:
            if self.engine.num_frames > 0:  # this push ran the scale step
                self._release_cached_blocks()  # the scale step's, which no graph replay reuses
            return predictions
        # Outside the handler: the error's traceback holds the failed step's tensors until it ends.
        self._drop_spare()
        return self.engine.push_checked(*frame)

    def _release_cached_blocks(self) -> None:
        """Where a spare runs or may: return the allocator's unused blocks to the device. An eager step's
        blocks stay cached on the stream that ran it, where the other engine's stream cannot take them;
        a spare is sized to hold one engine's eager step at a time (room_beside_engine)."""
        if self.device.type == "cuda" and self.lookahead is not False:
            gc.collect()  # (tensors a reference cycle still holds)
            torch.cuda.empty_cache()

    def _turn_spare_off(self, error: Exception) -> None:
        """The spare raised `error` or stalled (SpareStalled: its helper is down and said so already): it is
        off for the rest of the run, with one warning line (its helper's), and goes."""
        helper = self._rollover.spare.helper
        helper.fail(f"{type(error).__name__}: {error}")  # (the first reason stands: a stall's)
        self.spare_off = helper.down_reason
        self._drop_spare()

    def _drop_spare(self) -> None:
        """Go on without a spare: its worker stopped (a stalled one left behind) and its device memory
        returned."""
        self._rollover.close()
        self._rollover = None
        self.lookahead = self._spare_wanted = False  # (its pages stay lent: a worker left behind may write them)
        if self.device.type == "cuda":
            gc.collect()  # (the spare's engine and graphs, before the allocator returns their memory)
            torch.cuda.empty_cache()

    def _chunk_is_full(self) -> bool:
        if self._phase is Phase.CATCHING_UP:  # the closed chunk is; the next (on the spare) cannot be yet
            return False
        if self.closes_on_keyframes:
            # (a frame that could fill the chunk was decided at the end of its push, pipelined or not: the
            # chunk closes where the reference closes it; StreamConfig.closes_at_cached_frames)
            return self.engine.num_keyframes >= self.chunk_frames
        return self.num_frames - self.alignment.start >= self.chunk_length

    def _roll_over(self, frame: tuple[torch.Tensor, float]) -> bool:
        """Close the current chunk and open the next one on its last frames; True where `frame` went with them.

        In place, the new chunk predicts the shared frames now, and this frame after them, in one call of
        its engine (`start_over`). With a spare, the spare holds them (taken ahead, or handed over now), the
        closed chunk predicts this frame provisionally, and the spare takes over once it has caught up
        (models/stream/rollover.py).
        """
        closed_cached = self.engine.num_keyframes
        self._keyframe_counts.clear()  # the next chunk counts its own
        shared = self.overlap
        if self.closes_on_keyframes:
            # The reference never restarts inside the closing chunk's scale frames.
            shared = min(shared, self.num_frames - self.alignment.start - self.config.scale_frames)
        first_shared, shared_frames = self.num_frames - shared, list(self._replay)[len(self._replay) - shared:]
        beside = self._rollover is not None
        # The closing chunk's last frame may still be in flight (pipelined streaming): it belongs to this
        # chunk's emissions and to the tail the next chunk is aligned on.
        ended, begun = (self.engine.finish(), []) if beside else self.engine.start_over([*shared_frames, frame])
        self._outbox += self.alignment.receive(ended)
        closed = self.alignment.closed()
        self.alignment.open_next(first_shared, shared)
        self.rollovers += 1
        if beside:
            self._rollover.begin(closed, first_shared, shared_frames)
        self._outbox += self.alignment.receive(begun)
        logger.info(
            "chunk rollover: chunk %d closed after frames %d-%d (%d cached); chunk %d starts at frame %d "
            "and re-predicts %d frames%s",
            closed.index, closed.start, self.num_frames - 1, closed_cached, self.alignment.index,
            first_shared, shared, " (on the spare engine)" if beside else "",
        )
        return not beside

    # -- the next chunk, on the spare --------------------------------------------------------
    def _look_ahead(self, frame: tuple[torch.Tensor, float]) -> None:
        """After frame `num_frames` went to the current chunk: start a spare warmed on the stream's first
        frame (once, where `warm_up` did not), and, when chunks close at a known frame, hand the spare
        each frame the next chunk will share as it comes."""
        if self.lookahead is False or self._phase in (Phase.CATCHING_UP, Phase.SWITCH_PENDING):
            return  # (a chunk this short that the next lookahead would start now gets it at its rollover)
        index = self.num_frames
        if self._rollover is None:
            if index == 0:
                self._first_frame = frame[0]
            if index == self.config.scale_frames:  # once the engine's own first streaming step is recorded
                if self._spare_wanted:
                    self._start_spare(self._first_frame)
                self._first_frame = None
            return
        if not self.closes_on_keyframes:
            self._rollover.take_ahead(index, frame, self.alignment.start + self.chunk_length - self.overlap, self._replay)
            return
        self._keyframe_counts.append(self.engine.num_keyframes)
        first_shared = self._likely_first_shared(index)
        if first_shared is None and self._phase is Phase.AHEAD:  # no longer likely: kept until the rollover says
            first_shared = self._rollover.ahead_from
        if first_shared is not None:
            self._rollover.take_ahead(index, frame, first_shared, self._replay)

    def _likely_first_shared(self, index: int) -> int | None:
        """Where the next flow chunk likely starts, after frame `index` went to the current one: where
        it would if every frame from here on were a keyframe. None unless at least DENSE_KEYFRAMES of
        the last KEYFRAME_RATE_FRAMES frames were: then the guess is usually right, or a frame or two
        early (each miss costs the spare what it took; the stream waits for none of it). Elsewhere the
        spare takes the chunk's frames at its rollover, and has the time to catch up."""
        counts = self._keyframe_counts
        if len(counts) <= KEYFRAME_RATE_FRAMES or counts[-1] - counts[0] < DENSE_KEYFRAMES * KEYFRAME_RATE_FRAMES:
            return None
        remaining = self.chunk_frames - self.engine.num_keyframes
        # The chunk is full once `remaining` more frames are keyframes; undecided frames may be some.
        closes = index + 1 + max(0, remaining - self.engine.undecided_frames)
        return closes - min(self.overlap, closes - self.alignment.start - self.config.scale_frames)

    @property
    def spare_window_slots(self) -> int:
        """Window frames a spare's cache needs slots for (`_spare_slots` at the provisional room)."""
        return self._spare_slots(self._provisional_room, self.engine.config.window)

    def _spare_slots(self, provisional_room: int, window: int) -> int:
        """A spare takes a chunk's shared frames, the frames the closed chunk predicts provisionally and
        the one it then takes alone, and one more is pending while it steps; the current engine takes
        them over at the switch (SpareEngine.hand_over), so its cache needs slots for no more."""
        taken = self.overlap + provisional_room + 2
        return max(1, min(window, taken - self.config.scale_frames))

    def _spare_config(self, engine_config: StreamConfig | None = None) -> StreamConfig:
        """The spare's settings: the current engine's (`engine_config`: as its memory plan will make them)."""
        return replace(engine_config or self.engine.config, gpu_memory=None)

    def _start_spare(self, first_frame: torch.Tensor) -> None:
        """A spare engine, warmed on copies of the stream's first frame on its worker."""
        # Push back past the frames it may hold with a reason: the replay's (shared, provisional, the last one
        # alone), a flush and a fresh start.
        spare = SpareEngine(StreamingEngine(self.model, self._spare_config(), device=self.device,
                                            dtype=self.engine.dtype, window_slots=self.spare_window_slots,
                                            pages_of=self.engine.cache),
                            self.spare_limits, capacity=self.overlap + 1 + self._provisional_room + 2)
        spare.engine.memory_plan = self.engine.memory_plan
        spare.steps_eagerly(self._eager_steps)
        spare.warm(first_frame)
        self._spare_helper = spare.helper
        self._spare_image = first_frame
        self._rollover = Rollover(spare, self.alignment, self._provisional_room)
        self._replay = deque(self._replay, maxlen=self.overlap + 1 + self._provisional_room)

    def _spare_warmed(self) -> bool:
        """Wait for the spare's warm-up; False where it ran out of device memory. Its room is an estimate,
        and on a card with little to spare (a 16 GB card under --gpu-memory 16GiB) the
        spare's own warm-up can run out of memory beside the engine."""
        spare = self._rollover.spare
        try:  # its warm-up done: the stream's first frames share nothing with it
            spare.collect(Deadline(self.spare_limits.warm_up_s))
        except torch.OutOfMemoryError as error:
            logger.warning("out of device memory warming up the next chunk's spare (%s): the spare goes, rollovers "
                           "now pause the stream", str(error).partition(".")[0])
            self.spare_off = "out of device memory in its warm-up"
            return False
        except Exception as error:  # raised or stalled (its worker is left behind): off, as at a switch
            spare.helper.fail(f"its warm-up raised {type(error).__name__}: {error}")
            self.spare_off = spare.helper.down_reason
            return False
        self._release_cached_blocks()  # its warm-up's, before the stream's scale step
        return True

    def _switch_to_spare(self) -> None:
        """The spare's predictions of the new chunk so far, and its frames taken over by the current
        engine. If the spare failed, the rollover happens in place instead, and later ones too."""
        try:
            received = self._rollover.switch(self.engine)
        except Exception as error:  # raised on the worker (e.g. out of memory) or stalled: go on without a spare
            self._turn_spare_off(error)
            self.alignment.forget()
            self.engine.reset()  # the chunk's frames so far, through its engine
            frames = list(self._replay)[len(self._replay) - (self.num_frames - self.alignment.start):]
            self._outbox += self.alignment.receive([p for frame in frames for p in self.engine.push_checked(*frame)])
            return
        self.rollovers_ahead += 1
        self._outbox += received

    def _on_main_stream(self):
        """The current engine's device work, where a spare may run, on a CUDA stream of higher priority."""
        return contextlib.nullcontext() if self._main_stream is None else self._main_stream.entered()

    def _decide_spare(self, image_size: tuple[int, int]) -> None:
        """Before the current engine's first frame sets its cache up (once a stream's engine): whether a spare
        engine runs beside it, with how many provisional frames, and its pages lent by the current engine's
        storage (StreamingEngine.lend_pages): the spare's pages lie past the current chunk's in one allocation."""
        if self._spare_wanted is not None:
            return
        plan = self.engine.plan_memory_for(image_size)  # (the engine's settings once set up: its plan's)
        config = self.engine.config if plan is None else plan.apply(self.engine.config)
        self._spare_wanted = self._spare_fits(config, image_size)
        if self._spare_wanted:
            self.engine.lend_pages(cache_pages(self.model, self._spare_config(config), image_size,
                                               window_slots=self._spare_slots(self._provisional_room, config.window)))

    def _spare_fits(self, config: StreamConfig, image_size: tuple[int, int]) -> bool:
        """Whether to run a spare engine beside one of `config`: as asked, or (auto) on CUDA, with steps replayed
        as graphs, when a second engine fits beside the first by their estimates (in the budget, or in the free
        device memory less what the first will take); its provisional room (and so its cache) shrinks to fit
        where the whole room does not (spare_room.py)."""
        if self.lookahead is not None or self.device.type != "cuda":
            return bool(self.lookahead)
        if not config.cuda_graphs:  # steps launched op by op: a spare would contend for the interpreter
            logger.info("next chunk ahead of rollovers: off (steps are not replayed as CUDA graphs)")
            return False
        fitting = provisional_room_beside(self.model, config, image_size, self._provisional_room,
                                          lambda room: self._spare_slots(room, config.window), self.device)
        if fitting is None:
            return False
        self._provisional_room = fitting
        return True
