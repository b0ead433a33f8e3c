"""Worker threads for a run's helpers that nothing ever waits for without a limit, the process's exit included.

A ThreadPoolExecutor's workers are joined when the interpreter exits (concurrent.futures registers that
join), so a worker stalled in a step, a kernel build or a decode holds the process forever after the run
has ended; `shutdown(wait=False)` does not change that. `DaemonPool` runs the same futures on daemon
threads: `shutdown` cancels what has not started and returns at once, `join` waits at most until a
deadline, and a stalled worker is left behind when the process exits.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from .supervision import Deadline, Helper, supervise_thread


class DaemonPool:
    """Up to `workers` daemon threads named `{name}_{i}` (as ThreadPoolExecutor names its own), started as
    jobs come, taking them in order; each is `helper`'s (models/supervision.py). A job's error goes to its
    future: the pool's owner says what it does to the helper."""

    def __init__(self, workers: int, name: str, helper: Helper) -> None:
        self.workers, self.name, self.helper = workers, name, helper
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (future, function, args); None: a worker ends
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._lock = threading.Lock()
        # A pool dropped without `shutdown` still ends its idle workers (ThreadPoolExecutor's do so too):
        # they hold its queue, never the pool.
        self._end_workers = weakref.finalize(self, _end_workers, self._jobs, self._threads)

    def submit(self, function: Callable[..., Any], *args: Any) -> Future:
        """Run `function(*args)` on a worker; its future holds what it returns or raises."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: no job after shutdown")
            self._jobs.put((future, function, args))  # unbounded-ok: a SimpleQueue has no bound, put never waits
            if len(self._threads) < self.workers:
                thread = threading.Thread(target=_work, args=(self._jobs,), name=f"{self.name}_{len(self._threads)}",
                                          daemon=True)
                self._threads.append(thread)
                supervise_thread(self.helper, thread)
                thread.start()
        return future

    def shutdown(self) -> None:
        """Cancel the jobs not started and let each worker end after the job it runs; returns at once."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
            self._end_workers()

    @property
    def started(self) -> bool:
        """Whether a worker has been started (a job came)."""
        return bool(self._threads)

    def join(self, deadline: Deadline) -> bool:
        """After `shutdown`: wait for the workers until `deadline` at most; True when every one has ended."""
        for thread in list(self._threads):
            thread.join(timeout=deadline.remaining())
        return not any(thread.is_alive() for thread in self._threads)


def _end_workers(jobs: queue.SimpleQueue, threads: list[threading.Thread]) -> None:
    for _ in threads:
        jobs.put(None)  # unbounded-ok: a SimpleQueue has no bound, put never waits


def _work(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()  # unbounded-ok: a worker waits for its next job; a daemon thread, it holds no exit
        if job is None:
            return
        _run(*job)
        del job  # (what it returned is its future's alone while this worker waits for the next)


def _run(future: Future, function: Callable[..., Any], args: tuple) -> None:
    if not future.set_running_or_notify_cancel():
        return  # cancelled before it started
    try:
        result = function(*args)
    except BaseException as error:  # noqa: BLE001 - the future's owner raises it where it waits
        future.set_exception(error)
    else:
        future.set_result(result)
