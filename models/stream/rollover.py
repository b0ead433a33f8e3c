"""The rollover to the next chunk beside the stream: its phases, and the one object that owns them.

At a rollover the next chunk predicts its shared frames again: one scale step over the first
`scale_frames`, then one step per remaining frame, about 16 frames and 180 ms of GPU work at the
defaults. Done in place, that stops the stream for a quarter of a second or more. With a spare
engine (models/stream/lookahead.py) the work happens beside the stream instead, in four phases:

    STEADY ──(chunk end known or likely: its shared frames begin)──▶ AHEAD
      │  ▲                                                             │
      │  └──(the stream ended, the likely end moved (taken again from  │
      │      the new start), or the chunk closed elsewhere: dropped)───┤
      │                                                                │ rollover
      └──(rollover: the spare takes the shared frames now)─────────────┤
                                                                       ▼
                        CATCHING_UP ──(spare a frame behind, or no room left)──▶ SWITCH_PENDING
                        (skipped when the closed chunk has no provisional room)        │
                                                                                       │ next push
    STEADY ◀──(the current engine takes over the spare's frames; failed: in place)─────┘

Every transition goes through `Rollover._enter`, which refuses any other.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch

from ..supervision import Deadline
from .chunks import AlignedFrame, ChunkAlignment, ClosedChunk
from .engine import StreamingEngine
from .lookahead import SpareEngine
from .prediction import FramePrediction

logger = logging.getLogger("stream_recon.models.stream.rollover")

# While the spare has work for the next chunk, a push of the stream lasts up to PACE times its usual
# push: the spare has the device alone for the rest. 1.5 left the spare too little device time (46
# provisional frames at a flow rollover); 1.6 keeps it a frame behind.
PACE = 1.6
# While catching up, a push lasts up to CATCH_UP_PACE times the usual one where the spare is further
# behind than `catch_up_backlog` allows. A rollover may cost 2x the median interval at most, and an
# interval is the held push plus ~2 ms outside it (sinks, receiving) at a 29 ms median: at 2.0 the
# first pushes of a catch-up take 59-63 ms against a 28.7 ms median.
CATCH_UP_PACE = 1.8
# The current engine's CUDA stream (MainStream) where a spare may run (whose stream has the default
# priority, 0): lower numbers are more urgent.
MAIN_STREAM_PRIORITY = -1
# The most frames a closed chunk predicts provisionally while the next one catches up; then the
# stream waits for the spare. A chunk that closes at a known frame has had the spare take its shared
# frames ahead, and the spare catches up within 3-15 frames; a flow chunk's
# spare starts at the rollover and takes up to 48. The spare's cache holds these frames too
# (ChunkedEngine.spare_window_slots), so the room is also its memory.
MAX_PROVISIONAL = 48
MAX_PROVISIONAL_AHEAD = 20
# Where the spare does not fit with the whole room, the room shrinks in these steps, down to this.
PROVISIONAL_ROOM_STEP = 4
MIN_PROVISIONAL = 4


class Phase(enum.Enum):
    """Where the rollover to the next chunk stands.

    STEADY: the current chunk predicts every frame; the spare is idle and empty, nothing closed.
    AHEAD: the current chunk predicts every frame, and the spare has also taken every frame since
        `ahead_from`, the first frame the next chunk will share (chunks that close at a known frame),
        or will likely share (flow chunks of dense keyframes: ChunkedEngine._likely_first_shared).
    CATCHING_UP: the current chunk is closed (`closed`); the spare holds the next chunk and is more
        than a frame behind; the closed chunk predicts each new frame provisionally, uncached, so the
        stream need not wait, and the spare takes it too.
    SWITCH_PENDING: the closed chunk has stopped predicting; the spare is at most a frame behind and
        takes frames alone; at the next push or at the end the current engine takes its frames over.
    """

    STEADY = "steady"
    AHEAD = "ahead"
    CATCHING_UP = "catching up"
    SWITCH_PENDING = "switch pending"


_TRANSITIONS = {
    Phase.STEADY: {Phase.AHEAD, Phase.CATCHING_UP, Phase.SWITCH_PENDING},
    Phase.AHEAD: {Phase.STEADY, Phase.CATCHING_UP, Phase.SWITCH_PENDING},
    Phase.CATCHING_UP: {Phase.SWITCH_PENDING},
    Phase.SWITCH_PENDING: {Phase.STEADY},
}


class Rollover:
    """The spare engine and the phases of a rollover beside the stream (module docstring).

    It holds what only exists between a chunk's shared frames and the switch: the spare's predictions
    taken but not yet received (`ready`), the closed chunk, how many frames it predicted
    provisionally; and the pacing that gives the spare device time. The chunk bookkeeping is the
    ChunkAlignment it shares with ChunkedEngine; the current engine is handed in where it is needed.
    """

    def __init__(self, spare: SpareEngine, alignment: ChunkAlignment, provisional_room: int):
        self.spare = spare
        self.alignment = alignment
        self.provisional_room = provisional_room  # frames a closed chunk may predict while the next catches up
        self._push_seconds: deque[float] = deque(maxlen=32)  # the stream's own pushes, for pacing
        self._clear()

    def reset(self) -> None:
        """STEADY, the spare empty (what it was given is dropped), nothing closed or taken ahead. Raises
        what the spare raised, or SpareStalled where it does not answer within its wait (SPARE_WAIT_S): the caller
        then goes on without it."""
        self.spare.discard(Deadline(self.spare.limits.wait_s))
        self._clear()

    def _clear(self) -> None:
        self.phase = Phase.STEADY
        self.ahead_starts = 0  # times the spare began taking a next chunk's frames before its rollover
        self.ahead_from: int | None = None
        self.closed: ClosedChunk | None = None
        self.provisional_count = 0  # frames the closed chunk predicted since its rollover
        self.behind_at_start = 0  # the spare's unfinished frames when the chunk closed
        self.ready: list[FramePrediction] = []  # the spare's predictions, taken before they are received

    def _enter(self, phase: Phase) -> None:
        if phase not in _TRANSITIONS[self.phase]:
            raise RuntimeError(f"rollover: no transition from {self.phase.value} to {phase.value}")
        self.phase = phase

    @property
    def spare_has_work(self) -> bool:
        """The spare predicts the next chunk (the stream is paced)."""
        return self.phase is not Phase.STEADY

    # -- STEADY / AHEAD ----------------------------------------------------------------------
    def take_ahead(self, index: int, frame: tuple[torch.Tensor, float], first_shared: int,
                   recent: Sequence[tuple[torch.Tensor, float]]) -> None:
        """Frame `index` went to the current chunk, whose shared frames begin at `first_shared` (known,
        or the likeliest start of a flow chunk's: it may move from call to call): from there on the
        spare takes each frame too. Where the start moved, what the spare took is dropped and it takes
        the frames from the new start again, from `recent` (the stream's last frames, `frame` last)."""
        if self.phase is Phase.AHEAD and self.ahead_from != first_shared:
            self.drop_ahead()
        if self.phase is Phase.STEADY and index - len(recent) < first_shared <= index:
            self._enter(Phase.AHEAD)
            self.ahead_from = first_shared
            self.ahead_starts += 1
            for taken in list(recent)[len(recent) - (index - first_shared + 1):]:
                self.spare.push(*taken)
        elif self.phase is Phase.AHEAD:
            self.spare.push(*frame)

    def drop_ahead(self) -> None:
        """AHEAD -> STEADY: forget what the spare took for a chunk that does not come as it expected
        (the spare starts afresh on its worker: the stream does not wait for it)."""
        self.spare.drop()
        self._enter(Phase.STEADY)
        self.ahead_from = None
        self.ready, self.alignment.early_ratios = [], {}

    # -- the rollover --------------------------------------------------------------------------
    def begin(self, closed: ClosedChunk, first_shared: int, replay: list[tuple[torch.Tensor, float]]) -> None:
        """At a rollover: the spare holds the next chunk's shared frames from stream index
        `first_shared`, taken ahead or handed over now (`replay`: the last frames of the stream, those
        among them); the closed chunk predicts new frames until the spare has caught up."""
        if self.phase is Phase.AHEAD and self.ahead_from != first_shared:
            self.drop_ahead()
        if self.phase is Phase.STEADY:
            for frame in replay:
                self.spare.push(*frame)
        self.ahead_from = None
        self.closed, self.provisional_count = closed, 0
        self.behind_at_start = self.spare.backlog
        # Without room for provisional frames the spare takes over at the next call.
        self._enter(Phase.CATCHING_UP if self.provisional_room > 0 else Phase.SWITCH_PENDING)

    def push_beside(self, engine: StreamingEngine, frame: tuple[torch.Tensor, float]) -> list[FramePrediction]:
        """CATCHING_UP: the spare takes the frame, and the closed chunk (`engine`) predicts it now,
        uncached. Once the spare is a frame behind (or the closed chunk may go on no longer) the spare
        takes the frames alone (SWITCH_PENDING), and over at the next push."""
        if self.provisional_count and (self.spare.backlog <= 1 or self.provisional_count >= self.provisional_room):
            emitted = self.stop_provisional(engine)
            self.push_last(frame)
            return emitted
        self.spare.push(*frame)
        emitted = self.alignment.provisional(self.closed, engine.push_checked(*frame, cached=False))
        self.provisional_count += 1
        return emitted

    def push_last(self, frame: tuple[torch.Tensor, float]) -> None:
        """SWITCH_PENDING: the spare takes the last frame before the switch alone, and delivers what it
        has in flight on its worker while this push is paced, so that the switch, at the next push,
        waits for none of the spare's device work. Delivered at the switch instead, a pipelined spare's
        last step holds it 37 ms, and that push takes 99 ms against a 27 ms median interval."""
        self.spare.push(*frame)
        self.spare.flush()

    def stop_provisional(self, engine: StreamingEngine) -> list[FramePrediction]:
        """CATCHING_UP -> SWITCH_PENDING: the closed chunk's last provisional prediction."""
        emitted = self.alignment.provisional(self.closed, engine.finish())
        self._enter(Phase.SWITCH_PENDING)
        return emitted

    def take_ready(self, num_frames: int) -> list[FramePrediction]:
        """Take what the spare has predicted so far (never waiting). AHEAD: keep it (its depth ratios are
        made while the stream is paced). After the rollover (from the push after the one that closed
        the chunk): the emissions, once the transform's ratios are made."""
        alignment = self.alignment
        if self.phase is Phase.AHEAD:
            self.ready += self.spare.take_ready()
        elif self.closed is not None and num_frames > alignment.start + alignment.num_shared:
            self.ready += self.spare.take_ready()
            if alignment.transform is None:
                if len(self.ready) < alignment.num_shared or alignment.make_ratios(*self._ratios_to_make(), limit=0):
                    return []  # the transform waits for its ratios, made while the stream is paced
            taken, self.ready = self.ready, []
            return alignment.receive(taken)
        return []

    def switch(self, engine: StreamingEngine) -> list[FramePrediction]:
        """SWITCH_PENDING -> STEADY: the current engine (`engine`) takes the next chunk over from the
        spare, and the spare's predictions of it so far are received. Raises what the spare raised, or
        SpareStalled where it has not delivered within its wait (SPARE_WAIT_S; a frame behind, it needs tens
        of ms), in STEADY with the spare emptied: the caller then rolls over in place."""
        self.closed = None
        self._enter(Phase.STEADY)
        deadline = Deadline(self.spare.limits.wait_s)
        try:
            # The spare's last frames are still on the GPU: make the ratios left while waiting for the next.
            while (taken := self.spare.take_next(deadline)) is not None:
                self.ready += taken
                if self.alignment.transform is None:
                    self.alignment.make_ratios(self.ready, self.alignment.start, self.alignment.previous_tail)
            predictions = self.ready + self.spare.collect(deadline)
            predictions += self.spare.hand_over(engine)
            self.ready = []
        except Exception:
            self.ready, self.alignment.early_ratios = [], {}
            raise
        return self.alignment.receive(predictions)

    # -- pacing ----------------------------------------------------------------------------------
    def _ratios_to_make(self) -> tuple[list[FramePrediction], int, Iterable[AlignedFrame]] | None:
        """The spare's predictions whose depth ratios the next transform needs, the stream index of their
        chunk's first frame and the frames they pair with; None when no transform waits for any."""
        alignment = self.alignment
        if self.phase is Phase.AHEAD:
            return self.ready, self.ahead_from, alignment.tail
        if self.closed is not None and alignment.transform is None:
            return self.ready, alignment.start, alignment.previous_tail
        return None

    def pace(self, started: float) -> None:
        """While the spare has work for the next chunk, hold the stream until PACE times its usual push
        has passed since this one `started` (or the spare is done): the spare then has the device
        alone for a while after each frame, and the stream's thread makes the depth ratios the next
        transform needs meanwhile. While catching up, hold it on until the spare is no further behind
        than `catch_up_backlog` allows, or CATCH_UP_PACE times the usual push has passed. Otherwise,
        note how long the push took."""
        elapsed = time.perf_counter() - started
        if not self.spare_has_work:
            self._push_seconds.append(elapsed)
        elif self._push_seconds:
            usual = float(np.median(self._push_seconds))
            deadline = started + PACE * usual
            to_make = self._ratios_to_make()  # host work that waits for the transform, done in the meantime
            while to_make is not None and time.perf_counter() < deadline and self.alignment.make_ratios(*to_make,
                                                                                                      limit=1):
                pass
            self.spare.wait_until(deadline)
            if self.phase is Phase.CATCHING_UP:
                at_most = catch_up_backlog(self.behind_at_start, self.provisional_room, self.provisional_count)
                self.spare.wait_for_backlog(at_most, started + CATCH_UP_PACE * usual)

    def close(self) -> None:
        self.spare.close()


def catch_up_backlog(behind_at_start: int, room: int, provisional: int) -> int:
    """The most frames the spare may be behind after the closed chunk's `provisional`-th provisional
    frame, so that it is a frame behind at most when the room (`room` frames) is used up: from
    `behind_at_start` + 1 down to 1 in equal steps, so that the stream waits a little at every push
    rather than all at once at the switch. Where the room is small beside the spare's start (a spare
    of 16 slots on a 16 GB card), the spare was still 4-5 frames behind at the
    end of it and the switch stopped the stream for them: 100 ms against a 30 ms median interval."""
    left = max(0, room - provisional)
    return 1 + behind_at_start * left // max(1, room)


class MainStream:
    """The current engine's device work on a CUDA stream of higher priority than the spare's, so that
    the spare gets what the stream leaves of the GPU instead of slowing it down.

    All of it, the warm-up included: the caching allocator keeps freed blocks for the stream that
    freed them, and a first graph replay on a new stream pays extra, so a warm-up on another stream
    left the stream's scale step to allocate its memory again (27 cudaMalloc calls; that step 125 ms
    instead of ~80 at 518x392)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device, priority=MAIN_STREAM_PRIORITY)
        # One event each way between the caller's stream and this one, recorded again at every use:
        # creating one waits for the driver's lock, which a cudaMalloc on the spare's thread held for
        # 8 ms at a rollover (Stream.wait_stream creates one a call).
        self._entered, self._left = torch.cuda.Event(), torch.cuda.Event()

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Run the block on this stream, after the caller's stream's work so far; the caller's stream
        waits for what the block enqueued."""
        caller = torch.cuda.current_stream(self.stream.device)
        self._entered.record(caller)
        self.stream.wait_event(self._entered)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            self._left.record(self.stream)
            caller.wait_event(self._left)
