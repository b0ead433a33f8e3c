"""The contract every helper of a run keeps: a thread, a pool or a child process beside the run loop.

1. Work is handed to a helper by a call that never waits past a declared deadline. What happens when
   the helper is full is its policy's `WhenFull`: DROP (the item is skipped and counted), LATEST (it
   replaces the item still waiting), PUSH_BACK (the caller waits for room up to `push_back_s`; a helper
   that takes nothing for that long is stalled).
2. A helper is *down* once it raised, died, or made no progress (`beat`) for `stall_s` while it had
   work. What follows is its policy's `WhenDown`: TURN_OFF (its feature is off for the rest of the run,
   with one warning line and a record in run.json) or FAIL_RUN (the run loop gets `HelperDown` and the
   run ends "failed" with one error line, keeping what was written).
3. Only the run loop waits, and always with a deadline (`Deadline`, `HandOff.drain`, `LatestState.wait_idle`).
4. The mechanism knows every helper's threads and child processes: `start_supervised_thread`, a `DaemonPool`
   given its helper, and `supervise_child` record which `Helper` each belongs to (`helper_of_thread`,
   `helper_of_child`). A library's threads (viser's, asyncio's) belong to the helper that started the
   library: `LIBRARY_THREADS` names them in one place, by the helper and the reason.

PyTorch's DataLoader and vLLM's engine client are the models: liveness checked on a clock, a worker's
error re-raised where the caller is, never a wait on a helper that may never answer.
"""

from __future__ import annotations

import collections
import enum
import logging
import os
import selectors
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

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
    # PUSH_BACK: the longest a hand-off waits for room; LATEST: how long the newest item waits for room
    # before the oldest is dropped for it (a taker busy for a moment loses nothing)
    push_back_s: float = 0.0


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
    """One helper's state as its supervisor sees it: up or down (and why), its last progress, its drops.

    `library_threads`: where the helper runs a library that starts threads of its own (viser's server), a
    function that lists them as they are now; the helper owns them (`helper_of_thread`)."""

    def __init__(self, policy: HelperPolicy, library_threads: Callable[[], list[threading.Thread]] | None = None,
                 ) -> None:
        self.policy = policy
        self.dropped = 0
        self.down_reason: str | None = None
        self.library_threads = library_threads
        self._last_beat = time.monotonic()
        self._lock = threading.Lock()
        _HELPERS.add(self)

    @property
    def is_up(self) -> bool:
        return self.down_reason is None

    def beat(self) -> None:
        """The helper made progress (took an item, finished one, answered)."""
        self._last_beat = time.monotonic()

    def seconds_since_beat(self) -> float:
        return time.monotonic() - self._last_beat

    def stall_left(self) -> float:
        """Seconds until no progress counts as a stall; a helper with none left is marked down (stalled)."""
        left = self.policy.stall_s - self.seconds_since_beat()
        if left <= 0:
            self.fail(f"it made no progress for {self.policy.stall_s:g} s")
        return max(left, 0.0)

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
    """A bounded hand-off between the run loop and one helper's thread, by the helper's WhenFull policy,
    either way round.

    To a worker (the writer, the spare engine): the run loop's `offer` never waits past the policy's
    push_back_s; the worker takes with `take` and calls `done` when an item is finished (its beat); `drain`
    waits for the backlog with a deadline. From a helper (`gives`: the source's reader): the helper's thread
    hands over what it makes with `give` (its beat), by the policy: PUSH_BACK waits for the run loop to take
    (the run loop's pace), LATEST drops the oldest item waiting, DROP the new one (both counted); the run loop
    takes with `take`. `close` ends the hand-off either way: nothing more is accepted, and a thread waiting in
    `take` or `give` wakes at once; `discard` empties it. Nothing polls: every wait is on one Condition that
    each change notifies. `on_discard(item)`: called for an item that leaves it untaken (dropped, discarded).
    """

    def __init__(self, helper: Helper, capacity: int, *, gives: bool = False,
                 on_discard: Callable[[Any], None] | None = None) -> None:
        self.helper = helper
        self.capacity = capacity
        self.gives = gives
        self._on_discard = on_discard
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

    def give(self, item: Any) -> bool:
        """(The helper's thread, `gives`) hand `item` to the run loop by the policy; False when it was dropped
        or the hand-off is closed. PUSH_BACK waits for room as long as the run loop takes to make it: the
        helper's own wait, which `close` and `discard` end."""
        when_full = self.helper.policy.when_full
        grace = Deadline(self.helper.policy.push_back_s)  # (LATEST: the wait before the oldest is dropped)
        with self._changed:
            while len(self._items) >= self.capacity and not self._closed:
                if when_full is WhenFull.PUSH_BACK:
                    self._changed.wait()  # unbounded-ok: the helper waits for the run loop, which closes it
                    continue
                if when_full is WhenFull.LATEST and not grace.expired:
                    self._changed.wait(timeout=grace.remaining())
                    continue
                self.helper.dropped += 1
                self._left_untaken(self._items.popleft() if when_full is WhenFull.LATEST else item)
                if when_full is WhenFull.DROP:
                    return False
            if self._closed:
                return False
            self._items.append(item)
            self._changed.notify_all()
        self.helper.beat()
        return True

    def discard(self) -> None:
        """Empty the hand-off (each item's `on_discard`); a `give` waiting for room goes on."""
        with self._changed:
            while self._items:
                self._left_untaken(self._items.popleft())
            self._changed.notify_all()

    def _left_untaken(self, item: Any) -> None:
        if self._on_discard is not None:
            self._on_discard(item)

    def _room_made(self, when_full: WhenFull) -> bool:
        """(Holding the lock, the hand-off full) make room by the policy; False when the item is dropped."""
        if when_full is WhenFull.LATEST:
            grace = Deadline(self.helper.policy.push_back_s)
            while len(self._items) >= self.capacity and not self._closed and not grace.expired:
                self._changed.wait(timeout=grace.remaining())
            if len(self._items) < self.capacity or self._closed:
                return not self._closed
            self._left_untaken(self._items.popleft())
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
        """(True, item) for the worker (or, where the helper gives, the run loop), or (False, None) when none
        came within `timeout` or the hand-off is closed with nothing left (then at once; `closed` tells the
        two apart)."""
        deadline = Deadline(timeout)
        with self._changed:
            while not self._items and not self._closed and not deadline.expired:
                self._changed.wait(timeout=deadline.remaining())
            if not self._items:
                return False, None
            item = self._items.popleft()
            self._changed.notify_all()  # room for an offer or a give that waits
        if not self.gives:  # a worker's take is its progress; the run loop's is not the giver's
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
                stall_in = helper.stall_left()
                if not helper.is_up:
                    break
                # woken by `done`, or when a stall would be declared (a beat meanwhile moves that later)
                self._changed.wait(timeout=min(deadline.remaining(), stall_in))
            return self._unfinished == 0


class HelperOwner(Protocol):
    """What starts helpers of a run (a source, a sink, the engine, the builds, the monitor of children): each
    that ran, by run.json's name. A run asks its owners this, and only this."""

    def helpers(self) -> dict[str, Helper]: ...


def start_supervised_thread(helper: Helper, target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread of `helper`'s running `target`; whatever it raises marks the helper down with its reason."""

    def run() -> None:
        try:
            target()
        except BaseException as error:  # noqa: BLE001 - handed to the supervisor, never lost
            helper.fail(f"{type(error).__name__}: {error}")

    thread = threading.Thread(target=run, name=name, daemon=True)
    supervise_thread(helper, thread)
    thread.start()
    return thread


# Which helper each thread and child process of a run belongs to: weak, so that a finished run's helpers and
# threads go with it (a pid's entry goes with its helper).
_HELPERS: weakref.WeakSet[Helper] = weakref.WeakSet()
_THREAD_HELPERS: weakref.WeakKeyDictionary[threading.Thread, Helper] = weakref.WeakKeyDictionary()
_CHILD_HELPERS: weakref.WeakValueDictionary[int, Helper] = weakref.WeakValueDictionary()


def supervise_thread(helper: Helper, thread: threading.Thread) -> None:
    """Record `thread` (not started yet, or running) as one of `helper`'s."""
    _THREAD_HELPERS[thread] = helper


def supervise_child(helper: Helper, pid: int, died: Callable[[int], str] | None = None, *,
                    quiet: bool = False) -> None:
    """Record the child process `pid` as `helper`'s, and watch it (CHILDREN): a child that dies, exiting
    non-zero or killed by a signal, before its parent ends it (`ending_child`) marks `helper` down at once,
    with `died(returncode)` as the reason (a returncode as subprocess's: -N for signal N), `quiet` as
    Helper.fail's. The records of children that have gone are dropped first, so that a long batch, a few
    children a video, keeps no more records than live children."""
    for gone in [known for known in list(_CHILD_HELPERS) if not _alive(known)]:
        _CHILD_HELPERS.pop(gone, None)
    _CHILD_HELPERS[pid] = helper
    CHILDREN.watch(pid, died or (lambda code: f"its process {pid} died (exit status {code})"), quiet)


def ending_child(pid: int) -> None:
    """The parent ends the child `pid` now (a kill, a stop): its exit is no death of its helper's."""
    CHILDREN.forget(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process: alive)
        return True
    return True


def helper_of_thread(thread: threading.Thread) -> Helper | None:
    """The helper `thread` belongs to: the one that started it, or the one whose library started it; None for
    a thread no helper owns."""
    helper = _THREAD_HELPERS.get(thread)
    if helper is not None:
        return helper
    for owner in list(_HELPERS):
        if owner.library_threads is not None and any(found is thread for found in owner.library_threads()):
            return owner
    return None


def helper_of_child(pid: int) -> Helper | None:
    """The helper the child process `pid` belongs to, or None."""
    return _CHILD_HELPERS.get(pid)


# The monitor of the children: one that raises leaves each child's death to its owner's next check.
CHILD_MONITOR = HelperPolicy("watching the child processes", WhenFull.DROP, WhenDown.TURN_OFF, stall_s=60.0)


@dataclass
class _Watched:
    pid: int
    died: Callable[[int], str]
    quiet: bool
    fd: int  # its pidfd: readable once the process has exited


class ChildMonitor:
    """One thread waiting on every supervised child's sentinel (its pidfd, which Linux makes readable when the
    process exits), as vLLM's executor waits on its workers' sentinels: a child that dies marks its helper down
    when it dies, not at its owner's next check (the helper the registry names, `helper_of_child`). The thread
    starts with the first child and waits on nothing
    else (a pipe wakes it for a new child), so it never polls; the exit is read without reaping the child
    (WNOWAIT), which stays its owner's to wait for."""

    def __init__(self) -> None:
        self.helper = Helper(CHILD_MONITOR)
        self._lock = threading.Lock()
        self._watched: dict[int, _Watched] = {}  # pid -> its record, while it lives and its parent has not ended it
        self._new: list[_Watched] = []  # watched, not yet registered by the thread
        self._thread: threading.Thread | None = None
        self._selector: Any = None
        self._wake_write = -1

    def watch(self, pid: int, died: Callable[[int], str], quiet: bool) -> None:
        """Watch the child `pid` (its helper: `helper_of_child`) from now until it exits or its parent ends it."""
        try:
            fd = os.pidfd_open(pid)
        except (OSError, AttributeError):  # (gone and reaped already, or no pidfd here: its owner sees its end)
            return
        with self._lock:
            if self._thread is None:
                self._start()
            record = _Watched(pid, died, quiet, fd)
            self._watched[pid] = record
            self._new.append(record)
        os.write(self._wake_write, b"+")

    def forget(self, pid: int) -> None:
        with self._lock:
            self._watched.pop(pid, None)

    def helpers(self) -> dict[str, Helper]:
        """The monitor's thread, where it started, by run.json's name."""
        return {} if self._thread is None else {"child_monitor": self.helper}

    def _start(self) -> None:
        self._selector = selectors.DefaultSelector()
        wake_read, self._wake_write = os.pipe()
        self._selector.register(wake_read, selectors.EVENT_READ, None)
        self._thread = start_supervised_thread(self.helper, self._run, "child-monitor")

    def _run(self) -> None:
        while True:
            for key, _ in self._selector.select():  # (no timeout: a child's exit or a new child wakes it)
                if key.data is None:
                    os.read(key.fd, 4096)
                    with self._lock:
                        new, self._new = self._new, []
                    for record in new:
                        self._selector.register(record.fd, selectors.EVENT_READ, record)
                else:
                    self._exited(key.data)

    def _exited(self, record: _Watched) -> None:
        self._selector.unregister(record.fd)
        try:
            info = os.waitid(os.P_PIDFD, record.fd, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # reaped by its owner meanwhile: the owner has seen its end
            info = None
        finally:
            os.close(record.fd)
        with self._lock:
            mine = self._watched.pop(record.pid, None) is record
        if info is None or not mine:
            return
        code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        helper = helper_of_child(record.pid)
        if code != 0 and helper is not None:
            helper.fail(record.died(code), quiet=record.quiet)


CHILDREN = ChildMonitor()


State = TypeVar("State")


class LatestState(Generic[State]):
    """Latest wins for a helper whose work is a state rather than a queue of items (the live viewer's scene).

    The run loop merges each update into the one pending state (`update`: a newer update replaces what it
    supersedes while it waits, so memory stays bounded and nothing ever waits for room); the worker takes the
    whole of it at once (`take`), a fresh one left in its place, and says when it has finished (`done`).
    `wait_idle` waits, to a deadline, until the worker has taken and finished everything handed over. Nothing
    polls: the worker and `wait_idle` wait on one Condition that every change notifies.

        run loop: update ─▶ pending ◀─ take ─ worker ─ done ─▶ (updates += 1) ─▶ wait_idle returns
    """

    def __init__(self, helper: Helper, fresh: Callable[[State | None], State],
                 is_empty: Callable[[State], bool]) -> None:
        if helper.policy.when_full is not WhenFull.LATEST:
            raise ValueError(f"{helper.policy.name}: a LatestState is for a latest-wins helper, not "
                             f"{helper.policy.when_full.value}")
        self.helper = helper
        self._fresh, self._is_empty = fresh, is_empty  # fresh(taken): the pending state left after a take
        self._pending = fresh(None)
        self._nudged = False  # the worker is to run once though nothing is pending
        self._working = False  # it holds a state it took
        self._more_due = False  # its last run left work for a later one without anything new (`done`)
        self._closed = False
        self.updates = 0  # states the worker has finished
        self._changed = threading.Condition()

    def update(self, merge: Callable[[State], None]) -> None:
        """Merge into the pending state (`merge(pending)`, under the lock) and wake the worker."""
        with self._changed:
            merge(self._pending)
            self._changed.notify_all()

    def read(self, look: Callable[[State], Any]) -> Any:
        """`look(pending)` under the lock."""
        with self._changed:
            return look(self._pending)

    def nudge(self) -> None:
        """Wake the worker for one run although nothing is pending."""
        with self._changed:
            self._nudged = True
            self._changed.notify_all()

    def take(self, timeout: float | None) -> State:
        """(The worker) the pending state once something is pending, a nudge came, the state is closed, or
        `timeout` s passed (None: the worker's own wait for work, which holds no other thread)."""
        deadline = None if timeout is None else Deadline(timeout)
        with self._changed:
            while (self._is_empty(self._pending) and not self._nudged and not self._closed
                   and not (deadline is not None and deadline.expired)):
                self._changed.wait(None if deadline is None else deadline.remaining())  # unbounded-ok: the worker's
            taken, self._pending = self._pending, self._fresh(self._pending)
            self._nudged, self._working = False, True
        self.helper.beat()
        return taken

    def done(self, more_due: bool) -> None:
        """(The worker) the state it took is finished; `more_due`: it left work for a later run of its own."""
        self.helper.beat()
        with self._changed:
            self._working, self._more_due = False, more_due
            self.updates += 1
            self._changed.notify_all()

    @property
    def working(self) -> bool:
        with self._changed:
            return self._working

    @property
    def idle(self) -> bool:
        """Nothing pending, nothing in the worker's hands, nothing due."""
        with self._changed:
            return self._idle()

    def _idle(self) -> bool:
        return self._is_empty(self._pending) and not self._working and not self._more_due and not self._nudged

    def wait_idle(self, deadline: Deadline) -> bool:
        """Wake the worker and wait until it has run once more and is idle, until `deadline` at most, or until
        the helper is down (one that works past stall_s meanwhile is marked so); True when idle."""
        helper = self.helper
        with self._changed:
            target = self.updates + 1
            self._nudged = True
            self._changed.notify_all()
            while not (self._idle() and self.updates >= target) and helper.is_up and not deadline.expired:
                wait_s = deadline.remaining()
                if self._working:  # wake when a stall would be declared
                    stall_in = helper.stall_left()
                    if not helper.is_up:
                        break
                    wait_s = min(wait_s, stall_in)
                self._changed.wait(wait_s)
            return self._idle() and self.updates >= target and helper.is_up

    def close(self) -> None:
        """The worker's `take` returns at once from now on (what is pending with it)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    @property
    def closed(self) -> bool:
        with self._changed:
            return self._closed
