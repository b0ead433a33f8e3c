"""The contract every helper of a run keeps: a thread, a pool or a child process beside the run loop.

1. Work is handed to a helper by a call that never waits past a declared deadline. What happens when
   the helper is full is its policy's `WhenFull`: DROP (the item is skipped and counted), LATEST (it
   replaces the item still waiting), PUSH_BACK (the caller waits for room up to `push_back_s`; a helper
   that takes nothing for that long is stalled).
2. A helper is *down* once it raised, died, or made no progress (`beat`) for `stall_s` while it had
   work. What follows is its policy's `WhenDown`: TURN_OFF (its feature is off for the rest of the run,
   with one warning line and a record in run.json) or FAIL_RUN (the run loop gets `HelperDown` and the
   run ends "failed" with one error line, keeping what was written).
3. Only the run loop waits, and always with a deadline (`Deadline`, `HandOff.drain`).

PyTorch's DataLoader and vLLM's engine client are the models: liveness checked on a clock, a worker's
error re-raised where the caller is, never a wait on a helper that may never answer.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("stream_recon")


class WhenFull(enum.Enum):
    DROP = "drop"
    LATEST = "latest"
    PUSH_BACK = "push back"


class WhenDown(enum.Enum):
    TURN_OFF = "turn off"
    FAIL_RUN = "fail the run"


@dataclass(frozen=True)
class HelperPolicy:
    name: str  # as a user reads it: "loop closure", "the run writer"
    when_full: WhenFull
    when_down: WhenDown
    stall_s: float  # no progress for this long while it has work: stalled
    push_back_s: float = 0.0  # PUSH_BACK: the longest a hand-off waits for room


class HelperDown(RuntimeError):
    """A FAIL_RUN helper is down; the message is the run's one error line."""


class Deadline:
    """A point on the monotonic clock: `remaining()` seconds until it, never negative."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        return max(0.0, self.at - time.monotonic())

    @property
    def expired(self) -> bool:
        return time.monotonic() >= self.at


class Helper:
    """One helper's state as its supervisor sees it: up or down (and why), its last progress, its drops."""

    def __init__(self, policy: HelperPolicy) -> None:
        self.policy = policy
        self.dropped = 0
        self.down_reason: str | None = None
        self._last_beat = time.monotonic()
        self._lock = threading.Lock()

    @property
    def is_up(self) -> bool:
        return self.down_reason is None

    def beat(self) -> None:
        """The helper made progress (took an item, finished one, answered)."""
        self._last_beat = time.monotonic()

    def seconds_since_beat(self) -> float:
        return time.monotonic() - self._last_beat

    def fail(self, reason: str, *, quiet: bool = False) -> None:
        """Mark the helper down (the first reason stands); a TURN_OFF helper says so once, unless `quiet`
        (its owner says it in words of its own)."""
        with self._lock:
            if self.down_reason is not None:
                return
            self.down_reason = reason
        if self.policy.when_down is WhenDown.TURN_OFF and not quiet:
            logger.warning("%s is off for the rest of the run: %s", self.policy.name, reason)

    def check(self, has_work: bool) -> bool:
        """Mark a helper that had work but made no progress for `stall_s` down; raise HelperDown for a
        FAIL_RUN helper that is down. True while the helper is up."""
        if self.is_up and has_work and self.seconds_since_beat() > self.policy.stall_s:
            self.fail(f"it made no progress for {self.policy.stall_s:g} s")
        if not self.is_up and self.policy.when_down is WhenDown.FAIL_RUN:
            raise HelperDown(f"{self.policy.name} failed: {self.down_reason}")
        return self.is_up

    def record(self) -> dict[str, Any]:
        """What run.json says of the helper."""
        return {"up": self.is_up, "reason": self.down_reason, "dropped": self.dropped,
                "when_down": self.policy.when_down.value}


class HandOff:
    """A bounded hand-off from the run loop to one worker thread, by the helper's WhenFull policy.

    `offer` never waits past the policy's push_back_s; the worker takes with `take` and calls `done`
    when an item is finished (its beat); `drain` waits for the backlog with a deadline; `close` ends
    the hand-off: nothing more is accepted, and a worker waiting in `take` wakes at once.
    """

    def __init__(self, helper: Helper, capacity: int) -> None:
        self.helper = helper
        self.capacity = capacity
        self._items: collections.deque = collections.deque()
        self._unfinished = 0  # handed over and not yet done: waiting, or taken and in the worker's hands
        self._closed = False
        self._changed = threading.Condition()

    @property
    def backlog(self) -> int:
        with self._changed:
            return self._unfinished

    @property
    def closed(self) -> bool:
        """Closed, and nothing is left to take: the worker's loop ends."""
        with self._changed:
            return self._closed and not self._items

    def offer(self, item: Any) -> bool:
        """Hand `item` over; False when it was dropped (counted), the helper is down, or it is closed."""
        helper, when_full = self.helper, self.helper.policy.when_full
        if not helper.check(has_work=self.backlog > 0):
            return False
        with self._changed:
            if self._closed:
                return False
            if self._unfinished == 0:  # the stall clock runs from when it has work again, not from its last item
                helper.beat()
            self._unfinished += 1  # (counted while it waits for room too)
            try:
                handed = len(self._items) < self.capacity or self._room_made(when_full)
            except BaseException:  # (a KeyboardInterrupt while waiting for room): not handed over
                handed = False
                raise
            finally:
                if handed:
                    self._items.append(item)
                else:
                    self._unfinished -= 1
                self._changed.notify_all()
            if handed:
                return True
            if self._closed:  # closed while it waited: the end of the run, not a stall
                return False
        helper.dropped += 1
        if when_full is WhenFull.PUSH_BACK:
            helper.fail(f"it took nothing for {helper.policy.push_back_s:g} s")
            helper.check(has_work=True)
        return False

    def _room_made(self, when_full: WhenFull) -> bool:
        """(Holding the lock, the hand-off full) make room by the policy; False when the item is dropped."""
        if when_full is WhenFull.LATEST:
            self._items.popleft()
            self._unfinished -= 1
            self.helper.dropped += 1
            return True
        if when_full is WhenFull.PUSH_BACK:
            deadline = Deadline(self.helper.policy.push_back_s)
            while len(self._items) >= self.capacity and not self._closed and not deadline.expired:
                self._changed.wait(timeout=deadline.remaining())
            return len(self._items) < self.capacity and not self._closed
        return False

    def take(self, timeout: float) -> tuple[bool, Any]:
        """(True, item) for the worker, or (False, None) when none came within `timeout` or the hand-off
        is closed with nothing left (then at once; `closed` tells the two apart)."""
        deadline = Deadline(timeout)
        with self._changed:
            while not self._items and not self._closed and not deadline.expired:
                self._changed.wait(timeout=deadline.remaining())
            if not self._items:
                return False, None
            item = self._items.popleft()
            self._changed.notify_all()  # room for an offer that waits
        self.helper.beat()
        return True, item

    def done(self) -> None:
        """The worker finished an item it took."""
        self.helper.beat()
        with self._changed:
            self._unfinished -= 1
            self._changed.notify_all()

    def close(self) -> None:
        """Accept nothing more; the worker takes what is left, then its `take` returns at once."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def drain(self, deadline: Deadline) -> bool:
        """Wait until every item handed over is finished, the helper is down (one that makes no progress
        for stall_s meanwhile is marked so), or the deadline passes; True when drained."""
        helper = self.helper
        with self._changed:
            while self._unfinished and helper.is_up and not deadline.expired:
                if helper.seconds_since_beat() > helper.policy.stall_s:
                    helper.fail(f"it made no progress for {helper.policy.stall_s:g} s")
                    break
                self._changed.wait(timeout=min(deadline.remaining(), 0.1))
            return self._unfinished == 0


def start_supervised_thread(helper: Helper, target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread running `target`; whatever it raises marks the helper down with its reason."""

    def run() -> None:
        try:
            target()
        except BaseException as error:  # noqa: BLE001 - handed to the supervisor, never lost
            helper.fail(f"{type(error).__name__}: {error}")

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
