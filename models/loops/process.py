"""The loop closer in a child process of its own, and the stream's side of it, which never waits.

The child (`serve`) is one thread: it reads a message, calls the synchronous core (closer.py), writes the
reply. Detection (SIFT, matching, RANSAC, the 3D fit) and the pose graph then never hold the stream's
GIL. With the closer on a thread of the stream's process, the stream loses ~13 % of its steady FPS
(39.9 -> 34.7).

The stream's side (`LoopClosureProcess`) has no threads: every call writes what the pipe takes now and
reads what has arrived (models/child_process.py's outbox and inbox). It keeps the supervision contract
(models/supervision.py) as a TURN_OFF helper that drops what does not fit:
- which keyframes are indexed is a spacing rule (coverage.py), never the queue's timing: a keyframe due
  for indexing that finds `keyframes_in_flight` keyframes unanswered is not sent (counted), the next
  one is due instead, and the spacing doubles (one warning line the first time); links (a few hundred
  bytes a chunk) are always kept and sent;
- a child that dies, reports an error, or answers nothing for STALL_S while it has work is down: it is
  ended, loop closure is off for the rest of the run, and the corrections accepted so far stand;
- the end of a run waits for the child's last word with a deadline (`finish`).
"""

from __future__ import annotations

import collections
import logging
import os
import select
import subprocess
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..child_process import (
    MessageInbox,
    MessageOutbox,
    keep_freed_memory,
    read_message,
    start_child,
    write_message,
)
from ..stream.chunks import ChunkLink
from ..stream.prediction import FramePrediction
from ..supervision import Deadline, Helper, HelperPolicy, WhenDown, WhenFull
from .closer import FirstFinalKeyframes, LoopCloser, LoopClosureConfig, keyframe_of
from .corrections import ChunkCorrections
from .coverage import IndexingRule, IndexingSchedule
from .earlier_map import MapExtension, earlier_map_of
from .saved_map import MapRecorder, read_map

logger = logging.getLogger(__name__)

# The child is background work: the kernel schedules the stream's threads (the main loop, CUDA's, the
# writer's) first, and its libraries use two threads (OpenCV) or one (BLAS) instead of every core. With
# neither, the stream has 13 frame intervals over twice the median in 3,000 frames where it has none
# without loop closure.
CHILD_NICENESS = 10
CHILD_THREADS = 2
# Its BLAS on one thread: the pose graph's products are thin (rank-7 updates of a posterior of a few hundred
# rows, 7 x 7 blocks), where a second thread only contends with the stream for the other core: a stream's
# solve at 100 chunks took a median 67 ms with two threads on the 2-core machine, 19 ms with one.
CHILD_BLAS_THREADS = 1
# A child with messages unanswered for this long is stalled: one keyframe's detection takes 30-100 ms
# and a pose-graph solve of 1,000 chunks under a second, so 30 s is no slow answer but a stopped child.
STALL_S = 30.0
# The end of a run waits this long at most for the child's last word (the keyframes in flight, a solve).
FINISH_S = 30.0
# The child's start (a fresh interpreter importing NumPy, OpenCV, GTSAM and torch: 2-5 s, more on a busy
# machine) is not a stall: the stall clock starts at its first word, which it says after its imports.
START_S = 120.0
_SELECT_SLICE_S = 0.1  # a waiting `finish` looks at the child's liveness this often
_EXIT_WAIT_S = 1.0  # a child whose pipe has closed has exited or will within this


def serve(requests_fd: int, replies_fd: int) -> None:
    """The child: ("ready",) once imported; then it takes ("config", LoopClosureConfig), ("extends", (run folder,
    corrected)) for a stream extending an earlier run's map (earlier_map.py), ("map", folder), ("link",
    ChunkLink), ("keyframe", Keyframe), ("finish", None). Each message but the config is answered: ("ack",
    kind, corrections or None, summary or None), ("finished", corrections, summary), or ("error", text,
    summary) after which the child exits."""
    os.nice(CHILD_NICENESS)
    import cv2  # (here: the parent's side never needs OpenCV)

    cv2.setNumThreads(CHILD_THREADS)
    keep_freed_memory()  # (a SIFT and a check a keyframe: their temporaries kept for the next)
    closer: LoopCloser | None = None
    with os.fdopen(requests_fd, "rb") as requests, os.fdopen(replies_fd, "wb") as replies:
        write_message(replies, ("ready",))
        while True:
            try:
                kind, payload = read_message(requests)
            except EOFError:  # the parent has gone
                return
            try:
                if kind == "config":
                    closer = LoopCloser(payload)
                    continue
                if kind == "extends":  # read here, off the stream's path
                    closer = LoopCloser(closer.config, extension_of(*payload, closer.config))
                    continue
                if kind == "map":  # the saved map's folder (saved_map.py)
                    closer.record_map(MapRecorder(payload))
                    continue
                if kind == "finish":
                    write_message(replies, ("finished", closer.settle(), closer.summary()))
                    return
                write_message(replies, _answer(closer, kind, payload))
            except Exception as error:  # the parent turns loop closure off and keeps what was solved
                summary = closer.summary() if closer is not None else {}
                write_message(replies, ("error", f"{type(error).__name__}: {error}", summary))
                return


def extension_of(run_dir: str, corrected: bool, config: LoopClosureConfig) -> MapExtension:
    """The earlier run's map as the new stream's loop closer extends it."""
    saved = read_map(run_dir)
    return MapExtension(earlier_map_of(saved, saved.placement(corrected)), config)


def _answer(closer: LoopCloser, kind: str, payload: Any) -> tuple:
    """The answer to one message; the summary comes along whenever a candidate pair was recorded, so
    that a run stopped (or a child lost) later still lists every pair checked so far."""
    if kind == "link":
        closer.add_link(payload)
        return ("ack", kind, None, None)
    if kind != "keyframe":
        raise ValueError(f"unknown message {kind!r}")
    recorded = closer.pairs_recorded
    fresh = closer.add_keyframe(payload)
    summary = closer.summary() if fresh is not None or closer.pairs_recorded != recorded else None
    # the viewer draws only accepted loops; the whole story comes with the summary
    return ("ack", kind, None if fresh is None else replace(fresh, loops=fresh.accepted_loops), summary)


class LoopClosureProcess:
    """The stream's side of the loop-closure child; no call of it waits but `finish`, which has a deadline."""

    def __init__(self, config: LoopClosureConfig = LoopClosureConfig(), map_dir: str | None = None,
                 extends: tuple[str, bool] | None = None) -> None:
        """map_dir: where the child writes the saved map (saved_map.py) as it goes; None: no map. extends: an
        earlier run's folder whose map the stream extends, and whether its outputs are corrected by its last
        solve (SavedMap.placement)."""
        self.config = config
        self.helper = Helper(HelperPolicy("loop closure", WhenFull.DROP, WhenDown.TURN_OFF, stall_s=STALL_S))
        self._keyframes = FirstFinalKeyframes()
        self._schedule = IndexingSchedule(IndexingRule(config.index_spacing, config.max_index_spacing))
        self._said_lowered = False
        threads = {name: str(CHILD_BLAS_THREADS) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
        self._child = start_child(__name__, "serve", helper=self.helper, env={**os.environ, **threads},
                                  died=lambda code: f"its process ended (exit status {code})")
        self._outbox = MessageOutbox(self._child.requests)
        self._inbox = MessageInbox(self._child.replies)
        self._unanswered = 0  # messages sent (or waiting in the outbox) and not answered
        self._keyframes_unanswered = 0
        # chosen keyframes not yet handed over: a burst of due keyframes (a closed chunk's final emissions come
        # at once) waits here for room instead of lowering the density
        self._waiting: collections.deque = collections.deque()
        self._keyframes_answered = 0
        self._corrections = ChunkCorrections({})
        self._handed_version = 0
        self._summary: dict[str, Any] = {}
        self._finished = False
        self._ready = False
        self._started = Deadline(START_S)
        self._send(("config", config), answered=False)
        if extends is not None:
            self._send(("extends", extends), answered=False)
        if map_dir is not None:
            self.record_map(map_dir)

    def record_map(self, map_dir: str) -> None:
        """From now on the child writes the saved map (saved_map.py) into `map_dir` as it goes; before the
        first link or keyframe, which the map's files number from."""
        self._send(("map", str(map_dir)), answered=False)

    # -- the stream's side -------------------------------------------------------------------------
    def add_link(self, link: ChunkLink) -> None:
        """Chunk link.index's odometry; always kept (while loop closure is on)."""
        self._send(("link", link))

    def add_prediction(self, pred: FramePrediction) -> bool:
        """Hand a keyframe's first final emission over when the indexing rule chooses it; False otherwise."""
        if not self.helper.is_up:
            return False
        self._schedule.saw_frame(pred.frame_index)
        if not self._keyframes.admit(pred):
            return False
        has_room = (self._keyframes_unanswered + len(self._waiting)
                    < self.config.keyframes_in_flight + self.config.keyframes_waiting)
        # a child still importing is not slow detection: its keyframes wait, the density stays
        chosen = self._schedule.offer(pred.frame_index, has_room, may_lower=self._ready)
        self.helper.dropped = self._schedule.deferred
        if self._schedule.lowerings == 1 and not self._said_lowered:
            self._said_lowered = True
            logger.warning("loop closure: detection cannot keep up with the stream (%d keyframes unanswered): "
                           "one keyframe in %d frames is indexed from now on instead of one in %d",
                           self.config.keyframes_in_flight, self._schedule.spacing, self._schedule.rule.spacing)
        if not chosen:
            return False
        self._waiting.append(keyframe_of(pred))
        self._send_waiting()
        return True

    def _send_waiting(self, limit: int | None = None) -> None:
        """Hand waiting keyframes over while fewer than `limit` (keyframes_in_flight) are unanswered."""
        limit = self.config.keyframes_in_flight if limit is None else limit
        while self._waiting and self._keyframes_unanswered < limit and self.helper.is_up:
            self._keyframes_unanswered += 1
            self._send(("keyframe", self._waiting.popleft()))

    def take_corrections(self) -> ChunkCorrections | None:
        """What the child has answered since the last call: its newest corrections if not taken before."""
        self._exchange()
        if self._corrections.version == self._handed_version:
            return None
        self._handed_version = self._corrections.version
        return self._corrections

    def finish(self, deadline: Deadline, stop_now: Callable[[], bool] = lambda: False) -> ChunkCorrections:
        """Let the child answer everything in flight and take its last word, until `deadline` at most (or
        `stop_now`; a child still starting gets its START_S first); a child that misses it is ended and loop
        closure turned off. The corrections either way."""
        if self.helper.is_up:
            self._send_waiting(limit=len(self._waiting) + self._keyframes_unanswered)  # all of them, then the end
            self._send(("finish", None))
        while self.helper.is_up and not self._finished:
            if not self._ready and not stop_now():  # a short run can end before the child has started
                deadline = Deadline(deadline.seconds)
            elif deadline.expired or stop_now():
                why = "the run was stopped" if stop_now() else f"{deadline.seconds:g} s passed"
                self.helper.fail(f"it had not finished when {why} after the stream's end")
                break
            self._wait_for_pipes(min(deadline.remaining(), _SELECT_SLICE_S))
            self._exchange()
        self.close()
        return self._corrections

    @property
    def corrections(self) -> ChunkCorrections:
        return self._corrections

    @property
    def indexing(self) -> IndexingSchedule:
        return self._schedule

    @property
    def started(self) -> bool:
        """Whether the child has said it started (as of the last call)."""
        return self._ready

    def summary(self) -> dict[str, Any]:
        summary = {**self._summary, **self._schedule.summary()}
        summary["keyframes_indexed"] = max(summary.get("keyframes_indexed", 0), self._keyframes_answered)
        return summary

    def close(self) -> None:
        """End the child now, whatever it is doing."""
        self._child.close()

    # -- the pipes ----------------------------------------------------------------------------------
    def _send(self, message: tuple, *, answered: bool = True) -> None:
        try:
            self._outbox.put(message)
        except OSError as error:  # the child closed its end: it has died, maybe saying why first
            self._pipe_broken(error)
            return
        if answered:
            if self._unanswered == 0:
                self.helper.beat()  # the stall clock runs from the oldest unanswered message
            self._unanswered += 1

    def _exchange(self) -> None:
        """Read what has arrived, write what the pipe takes, and check the child's liveness."""
        if not self.helper.is_up:
            return
        self._take_replies()
        self._send_waiting()
        try:
            self._outbox.pump()
        except OSError as error:
            self._pipe_broken(error)
        if not self.helper.is_up:
            return
        if not self._ready:
            if self._started.expired:
                self._down(f"its process had not started {START_S:g} s later")
            return
        if not self.helper.check(has_work=self._unanswered > 0):
            self.close()

    def _take_replies(self) -> None:
        try:
            replies = self._inbox.take()
        except EOFError:
            replies = []
        for reply in replies:
            if self.helper.is_up:
                self._receive(reply)
        if self._inbox.closed and self._owes_its_last_word:  # (its last replies, if any, taken above)
            self._down(f"its process ended (exit status {self._exit_status()})")

    def _pipe_broken(self, error: OSError) -> None:
        # A child that dies closes its pipes one after the other: the requests' end can be closed while its
        # replies' end is not yet. Once it has exited (the status, waited for), the end of its replies is seen.
        status = self._exit_status()
        self._take_replies()  # its last words (an error it reported, or its end) say more than the broken pipe
        if self._owes_its_last_word:
            self._down(f"its process stopped taking messages ({error}; exit status {status})")

    @property
    def _owes_its_last_word(self) -> bool:
        """Up and not yet finished: the end of its pipes now is a death; after its last word, its normal exit."""
        return self.helper.is_up and not self._finished

    def _exit_status(self) -> int | None:
        """The child's exit status, once its end is seen: it has exited, or is about to."""
        try:
            return self._child.process.wait(timeout=_EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            return None

    def _receive(self, reply: tuple) -> None:
        kind = reply[0]
        self.helper.beat()
        if kind == "ready":
            self._ready = True
        elif kind == "ack":
            _, what, corrections, summary = reply
            self._unanswered -= 1
            if what == "keyframe":
                self._keyframes_unanswered -= 1
                self._keyframes_answered += 1
            if corrections is not None:
                self._corrections = corrections
            if summary is not None:
                self._summary = summary
        elif kind == "finished":
            _, self._corrections, self._summary = reply
            self._finished = True
        else:  # ("error", text, summary)
            self._summary = reply[2] or self._summary
            self._down(f"it failed: {reply[1]}")

    def _wait_for_pipes(self, timeout: float) -> None:
        writable = [self._outbox_fd] if self._outbox.pending else []
        select.select([self._inbox.fileno()], writable, [], timeout)

    @property
    def _outbox_fd(self) -> int:
        return self._child.requests.fileno()

    def _down(self, reason: str) -> None:
        self.helper.fail(reason)
        self.close()
