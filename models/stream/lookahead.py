"""The spare engine: the next chunk predicted beside the stream, so that a rollover does not stop it.

A second StreamingEngine driven from a worker thread, on a CUDA stream of its own, takes the next
chunk's shared frames (models/stream/rollover.py says when) while the current chunk goes on. It runs the
same model steps on the same frames in the same order as a rollover in place, so what it predicts
is the same. It needs a cache and recorded graphs of its own: it is warmed once on copies of the
stream's first frame (StreamingEngine.warm_up: its graph is recorded then, never at a rollover). At
the switch the current engine takes its frames over (a copy of the cache's contents, a few
milliseconds), so the spare's cache holds only what it takes before then (ChunkedEngine sizes it
and decides whether there is room). Its CUDA stream has the default priority; the stream's has a
higher one, so the spare gets what the stream leaves. Its own kernels may use only SPARE_SM_SHARE of the
SMs (models/stream/sm_partition.py), so that the stream's next kernel finds SMs free; its steps' CUDA graphs,
recorded on a plain stream, run on every SM wherever they are replayed.

The spare is a helper of the run (models/supervision.py): its frames go to its worker through a bounded
HandOff that pushes back (a push waits for room SPARE_WAIT_S at most: the spare is stalled past it), and the
stream waits for it SPARE_WAIT_S at most (its warm-up SPARE_WARM_UP_S); one that stalls past that, or raises,
is turned off for the rest of the run (ChunkedEngine drops it, and its rollovers happen in place), and its
worker, a daemon, holds no exit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from ..supervision import Deadline, HandOff, Helper, HelperPolicy, WhenDown, WhenFull, start_supervised_thread
from .engine import StreamingEngine
from .prediction import FramePrediction
from .sm_partition import device_sm_count, partitioned_stream

# The share of the GPU's SMs that the spare's eager kernels (its scale step) may use. Beside the spare's
# eager scale step on every SM, a stand-in of the stream's step took 2.9x its time alone (51.8 against
# 18.0 ms), 1.55x with the spare on 80 of 132 SMs, whose scale steps then came 29 % less often
# (scripts/probes/probe_sm_partition.py). On the product path the uncompiled flow
# rows' worst rollover interval falls from 2.02-2.07x the median to 1.68-1.90x; the spare ends its
# catch-ups a few frames later. 1: a plain stream on every SM.
SPARE_SM_SHARE = 0.6
# The longest the stream waits for the spare (at the switch, at the stream's end, at a reset), after which
# the spare has stalled: it is dropped and rollovers happen in place. The longest wait with a reason is the
# stream's end with the spare a whole provisional room behind (48 steps, rollover.MAX_PROVISIONAL: about
# 1 s at 518x392); at the switch it is a frame behind, tens of ms.
SPARE_WAIT_S = 5.0
# The spare's warm-up, waited for before the stream's first frame: 1.25-1.44 s (its graph
# recorded, its model's kernels built by then); twenty times that, it has stalled.
SPARE_WARM_UP_S = 30.0
# Jobs (frames, a flush, a fresh start) handed to the spare and not started, when its owner gives no bound.
SPARE_QUEUE = 64
# The worker's longest wait in one take: closing wakes it at once.
_WORKER_TAKE_S = 5.0


@dataclass(frozen=True)
class SpareLimits:
    """How long the stream waits for the spare (`wait_s`: a job's result, or room for a frame) and for its
    warm-up (`warm_up_s`); by default the module's constants as they are when the limits are made."""

    wait_s: float = field(default_factory=lambda: SPARE_WAIT_S)
    warm_up_s: float = field(default_factory=lambda: SPARE_WARM_UP_S)

    @property
    def policy(self) -> HelperPolicy:
        return HelperPolicy("the next chunk's lookahead", WhenFull.PUSH_BACK, WhenDown.TURN_OFF,
                            stall_s=self.wait_s, push_back_s=self.wait_s)


class SpareStalled(RuntimeError):
    """The spare did not finish what the stream waited for before the deadline (its helper is down)."""


class SpareEngine:
    """A StreamingEngine driven from a worker thread, on its own CUDA stream, until it is handed over."""

    def __init__(self, engine: StreamingEngine, limits: SpareLimits | None = None, capacity: int = SPARE_QUEUE):
        """`limits`: its waits (None: SpareLimits()); `capacity`: the jobs handed over and not started beyond
        which a push waits for room (push back)."""
        self.engine = engine
        self.limits = limits = limits or SpareLimits()
        self._stream = spare_stream(engine.device)
        # Down once it stalled here (SpareStalled), or where its owner turns it off for what it raised.
        self.helper = Helper(limits.policy)
        self._handoff = HandOff(self.helper, capacity)
        # A daemon worker (started with the first job): one stalled in a step holds neither `close` nor the
        # process's exit.
        self._worker: threading.Thread | None = None
        self._jobs: list[Future] = []  # each job's result, oldest first, until it is taken
        self.warm_seconds: float | None = None  # how long `warm` took on the worker, once it has
        self.eager_steps = False  # what `steps_eagerly` last told it (an engine starts as prepared); read every push

    def steps_eagerly(self, eager: bool) -> None:
        """StreamingEngine.steps_eagerly for its engine, called where its worker is idle."""
        self.eager_steps = eager
        self.engine.steps_eagerly(eager)

    def warm(self, image: torch.Tensor) -> None:
        """Warm the spare on copies of a stream's first frame (StreamingEngine.warm_up) on its worker:
        its first streaming step compiles and records its graph, which then never happens at a rollover."""
        self._submit(self._warm, image)

    def push(self, image: torch.Tensor, timestamp: float) -> None:
        """Queue a frame as `check_frame` returned it (StreamingEngine.push_checked); its prediction
        comes back from `take_ready`, `take_next` or `collect`."""
        self._submit(self.engine.push_checked, image, timestamp)

    def flush(self) -> None:
        """After the frames queued so far, deliver on the worker what the spare still has in flight
        (StreamingEngine.finish: a pipelined step's last frame); its predictions come back as a frame's
        do, and `hand_over` then waits for no device work of the spare's."""
        self._submit(self.engine.finish)

    @property
    def backlog(self) -> int:
        """Queued jobs (frames, and a flush) that have not finished yet."""
        return sum(not job.done() for job in self._jobs)

    def wait_until(self, deadline: float) -> None:
        """Wait for the queued jobs until `deadline` (time.perf_counter seconds) at the latest.

        The stream's thread calls this while the spare is behind: time it spends here is device time
        the spare gets alone (Rollover.pace paces the stream so)."""
        self.wait_for_backlog(0, deadline)

    def wait_for_backlog(self, at_most: int, deadline: float) -> None:
        """Wait until at most `at_most` queued frames are unfinished (the worker runs them in order), or
        until `deadline` (time.perf_counter seconds)."""
        unfinished = [job for job in self._jobs if not job.done()]
        timeout = deadline - time.perf_counter()
        if len(unfinished) > at_most and timeout > 0:
            wait([unfinished[len(unfinished) - at_most - 1]], timeout=timeout)

    def take_ready(self) -> list[FramePrediction]:
        """The predictions of the oldest queued frames whose jobs have finished, without waiting; they
        are not returned again by `collect`. A failed job stays queued (its error surfaces there)."""
        results = []
        while self._jobs and self._jobs[0].done() and self._jobs[0].exception() is None:
            results += self._jobs.pop(0).result() or []  # unbounded-ok: the job is done
        return results

    def take_next(self, deadline: Deadline | None = None) -> list[FramePrediction] | None:
        """Wait for the oldest queued frame's job until `deadline` (default `limits.wait_s` from now) and take
        its predictions; None when nothing is queued or when that job failed (its error surfaces in
        `collect`). SpareStalled when the deadline passes first."""
        if not self._jobs:
            return None
        if self._outcome(self._jobs[0], deadline or Deadline(self.limits.wait_s)) is not None:
            return None
        return self._jobs.pop(0).result() or []  # unbounded-ok: _outcome waited for it with the deadline

    def collect(self, deadline: Deadline | None = None) -> list[FramePrediction]:
        """Wait for every queued frame until `deadline` (default `limits.wait_s` from now); the predictions
        their pushes returned, oldest first. The current stream then waits for the spare's device work.
        Raises the first error of a job once every job is done, or SpareStalled when the deadline passes
        first (the jobs are forgotten: the spare is dropped then)."""
        deadline = deadline or Deadline(self.limits.wait_s)
        jobs, self._jobs = self._jobs, []
        results, errors = [], []
        for job in jobs:
            error = self._outcome(job, deadline)
            if error is None:
                results += job.result() or []  # unbounded-ok: _outcome waited for it with the deadline
            else:  # the others still run to completion before the error surfaces
                errors.append(error)
        if self._stream is not None:
            torch.cuda.current_stream(self.engine.device).wait_stream(self._stream)
        if errors:
            raise errors[0]
        return results

    def _outcome(self, job: Future, deadline: Deadline) -> BaseException | None:
        """What `job` raised (None: it returned), once it is done; SpareStalled, marking the spare down,
        where it is not done by `deadline`."""
        try:
            return job.exception(timeout=deadline.remaining())
        except FutureTimeout:
            self.helper.fail(f"it made no progress for {deadline.seconds:g} s")
            raise SpareStalled(f"the next chunk's spare made no progress for {deadline.seconds:g} s") from None

    def drop(self) -> None:
        """Start the spare afresh without waiting: frames queued but not started are cancelled, and
        the frame it is stepping now is finished and dropped on its worker, before anything queued
        after this call."""
        for job in self._jobs:
            job.cancel()
        self._jobs = []
        self._submit(self._start_afresh)

    def _start_afresh(self) -> None:
        self.engine.finish()
        self.engine.reset()

    def discard(self, deadline: Deadline | None = None) -> None:
        """Wait for what was queued (until `deadline`, as `collect`) and start the spare afresh, its
        predictions dropped. A stalled spare's engine is left as it is: its worker may still be in it."""
        try:
            self.collect(deadline)
        except SpareStalled:
            raise
        except Exception:
            self._start_afresh()
            raise
        self._start_afresh()

    def hand_over(self, current: StreamingEngine) -> list[FramePrediction]:
        """After `collect`: `current` (the closed chunk's engine, finished) goes on with the spare's
        stream, its caches' contents copied (`StreamingEngine.take_over`), and the spare starts afresh.
        Returns the spare's last predictions, in flight until now (a pipelined spare keeps one).

        The current engine keeps its cache and recorded graphs, so the spare's cache need only hold
        what it takes before the switch (`window_slots`), not a whole window."""
        last = self.engine.finish()
        current.reset()
        current.take_over(self.engine)
        self.engine.reset()
        if self._stream is not None:
            # The spare's next job writes its cache: after the copy out of it.
            self._stream.wait_stream(torch.cuda.current_stream(current.device))
        return last

    def close(self) -> None:
        """Stop the worker: queued jobs are cancelled, and the one it runs gets until `limits.wait_s` to end
        (none where the spare has stalled already); a worker still running then is left behind."""
        for job in self._jobs:
            job.cancel()
        self._handoff.close()
        if self._worker is not None:
            self._worker.join(timeout=self.limits.wait_s if self.helper.is_up else 0.0)

    def _submit(self, function, *args) -> None:
        """Hand a job to the worker (push back: waiting for room `limits.wait_s` at most); a job the spare
        could not take (it is down, or stalled now) fails with SpareStalled where the stream waits for it."""
        job: Future = Future()
        self._jobs.append(job)
        if self._worker is None:
            self._worker = start_supervised_thread(self.helper, self._work, "stream-recon-next-chunk")
        if not self._handoff.offer((job, function, args)):
            job.set_exception(SpareStalled(f"the next chunk's spare is off: {self.helper.down_reason}"))

    def _work(self) -> None:
        """The worker thread: each job handed over, in order, until the spare is closed; a cancelled one is
        skipped, and what a job raises goes to its future."""
        while not self._handoff.closed:
            taken, item = self._handoff.take(timeout=_WORKER_TAKE_S)
            if not taken:
                continue
            job, function, args = item
            try:
                if job.set_running_or_notify_cancel():
                    try:
                        job.set_result(self._on_stream(function, *args))
                    except BaseException as error:  # noqa: BLE001 - the stream raises it where it waits
                        job.set_exception(error)
            finally:
                del job, item  # (what it returned is its future's alone while the worker waits for the next)
                self._handoff.done()

    def _on_stream(self, function, *args):
        with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
            return function(*args)

    def _warm(self, image: torch.Tensor) -> None:
        started = time.perf_counter()
        # Its model's kernels were built by the current engine's warm-up, before this one starts: a dry
        # pass here would only run the steps once more (0.3-0.8 s).
        self.engine.warm_up(image)
        self.warm_seconds = time.perf_counter() - started


def spare_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The spare's CUDA stream (None off CUDA): on SPARE_SM_SHARE of the device's SMs where the driver can
    partition them, else a plain one; the default priority either way."""
    if device.type != "cuda":
        return None
    if SPARE_SM_SHARE < 1:
        stream = partitioned_stream(device, max(1, round(SPARE_SM_SHARE * device_sm_count(device))))
        if stream is not None:
            return stream
    return torch.cuda.Stream(device)
