"""The next window, predicted a little at a time beside the current one, so that a rollover does not pause the stream.

At a rollover the new window predicts its shared frames again (models/windowed.py): one scale step
over the first `scale_frames` of them, then one step per remaining frame, about 16 frames of work at
the defaults (~180 ms on an H100). Done at once, that work stops the stream; started early and left to
the GPU beside the stream, most of it still lands on the rollover (the GPU is busy with the stream).
So a second engine, the spare, takes the next window's frames as they arrive, on a worker thread,
and the stream hands it a budget of device time after each of its own frames (`advance`): the spare
issues stages of its work (a whole streaming step, or one stage of a scale step: models/pacing.py)
until the next one would overrun the budget, then waits for the next frame's turn. Every frame of
the stream then costs its own step plus at most about one budget, and the spare catches up a little
each frame; the windowed engine swaps the two engines once the spare has caught up with the stream.

The spare runs the same model steps on the same frames in the same order as a rollover in place, so
what it predicts is the same. Paced work runs on the stream's own CUDA stream, in order with it: a
stage's device time, timed by events around it, is its own (no frame of the stream runs in between),
and it is what the next stage of that kind is expected to cost. The spare needs a cache and recorded
graphs of its own: it is warmed once on the stream's first frames, on a CUDA stream of its own (its
graph is recorded then, never at a rollover), and it costs a second engine's memory (WindowedEngine
decides whether there is room).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from .engine import StreamingEngine
from .pacing import at_stage_boundaries, is_capturing
from .prediction import FramePrediction

StageKey = tuple[int, int]  # (frames the engine had received when the job began, capped at scale_frames; stage index)


class SpareEngine:
    """A StreamingEngine driven from a worker thread until it is handed over; its pushes paced by `advance`."""

    def __init__(self, engine: StreamingEngine):
        self.engine = engine
        self._own_stream = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" else None
        self.job_times: list[tuple[str, float, float]] = []  # (job, start, end), perf_counter seconds
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-recon-next-window")
        self._jobs: list[Future] = []
        # Pacing, shared with the worker under `_turn`: the device ms the worker may still issue (each
        # turn adds its budget; what a turn overdraws, up to a budget, or leaves, up to a quarter
        # budget, carries to the next), whether the turn has let a stage through yet, whether the
        # worker waits for a turn, and whether everything runs without turns (collect).
        self._turn = threading.Condition()
        self._credit = 0.0
        self._fresh = False
        self._waiting = False
        self._draining = False
        self._unfinished = 0
        # Worker only: what each stage cost when last timed, and the stage being issued.
        self.stage_costs: dict[StageKey, float] = {}
        self._stage: StageKey | None = None
        self._stage_start: torch.cuda.Event | float | None = None
        self._timings: deque[tuple[StageKey, torch.cuda.Event | float, torch.cuda.Event | float]] = deque()

    # -- the calling thread ----------------------------------------------------------------
    def warm(self, frames: list[tuple[torch.Tensor, float]]) -> None:
        """Run the first frames of a stream through the spare and forget them, in turns like the
        frames of a lookahead: its first streaming step records its graph (never at a rollover), the
        next one replays it, and every stage is timed once on its own (what the first rollover's
        turns are planned with; timed beside the stream they would count the stream's work too)."""
        stream = torch.cuda.current_stream(self.engine.device) if self._own_stream is not None else None
        for image, timestamp in frames:
            self._submit(self._warm_push, stream, True, image, timestamp)
        self._submit(self._forget, stream, True)

    def push(self, image: torch.Tensor, timestamp: float) -> None:
        """Queue a frame, to be issued on the caller's current CUDA stream in the turns `advance`
        gives; its prediction comes back from `collect`."""
        stream = torch.cuda.current_stream(self.engine.device) if self._own_stream is not None else None
        self._submit(self.engine.push, stream, True, image, timestamp)

    def advance(self, budget_ms: float) -> None:
        """Give the spare a turn: it issues queued work worth about `budget_ms` of device time, and
        this returns when it waits for the next turn or has nothing left. A turn's first stage always
        goes, the next ones when at least half of them fits in the credit: turns average `budget_ms`
        and overrun it by at most half a stage (what a turn overran, the next one issues less)."""
        with self._turn:
            self._credit = min(max(self._credit, -budget_ms) + budget_ms, 1.25 * budget_ms)
            self._fresh = True  # a turn lets at least one stage through
            self._waiting = False
            self._turn.notify_all()
            self._turn.wait_for(lambda: self._waiting or self._unfinished == 0)

    @property
    def idle(self) -> bool:
        """Whether every queued frame has been issued and run (its predictions wait in `collect`)."""
        with self._turn:
            return self._unfinished == 0

    def collect(self) -> list[FramePrediction]:
        """Let every queued frame run without turns and wait for them; the predictions their pushes
        returned, oldest first. The current stream then waits for the spare's device work. Raises
        the first error of a job."""
        with self._turn:
            self._draining, self._waiting = True, False
            self._turn.notify_all()
        jobs, self._jobs = self._jobs, []
        results, errors = [], []
        try:
            for job in jobs:
                try:
                    results += job.result() or []
                except Exception as error:  # the others still run to completion before the error surfaces
                    errors.append(error)
        finally:
            with self._turn:
                self._draining, self._credit, self._fresh = False, 0.0, False
        if self._own_stream is not None:
            torch.cuda.current_stream(self.engine.device).wait_stream(self._own_stream)
        if errors:
            raise errors[0]
        return results

    def discard(self) -> None:
        """Wait for what was queued and start the spare afresh, its predictions dropped."""
        try:
            self.collect()
        finally:
            self.engine.finish()
            self.engine.reset()

    def swap(self, closed: StreamingEngine) -> StreamingEngine:
        """After `collect`: hand the spare's engine over (to be driven from the calling thread) and
        keep `closed`, reset, as the next spare."""
        opened, self.engine = self.engine, closed
        closed.reset()
        return opened

    def close(self) -> None:
        with self._turn:
            self._draining, self._waiting = True, False
            self._turn.notify_all()
        self._worker.shutdown(wait=True)

    def _submit(self, function, stream: torch.cuda.Stream | None, paced: bool, *args) -> None:
        with self._turn:
            self._unfinished += 1
        self._jobs.append(self._worker.submit(self._run_job, function, stream, paced, *args))

    # -- the worker ------------------------------------------------------------------------
    def _run_job(self, function, stream: torch.cuda.Stream | None, paced: bool, *args):
        started = time.perf_counter()
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                if stream is not None and stream is not self._own_stream:
                    stream.wait_stream(self._own_stream)  # after the warm-up's work on the spare
                kind = min(self.engine.frames_received, self.engine.config.scale_frames)
                with at_stage_boundaries(lambda: self._next_stage(paced)):
                    self._begin_stage((kind, 0), paced)
                    try:
                        return function(*args)
                    finally:
                        self._end_stage()
        finally:
            self.job_times.append((function.__name__, started, time.perf_counter()))
            del self.job_times[:-64]
            with self._turn:
                self._unfinished -= 1
                self._turn.notify_all()

    def _next_stage(self, paced: bool) -> None:
        kind, index = self._stage
        self._end_stage()
        self._begin_stage((kind, index + 1), paced)

    def _begin_stage(self, stage: StageKey, paced: bool) -> None:
        """Wait for a turn with room for this stage (paced jobs), then mark its start. Inside a CUDA
        graph capture neither: reading an event or waiting there would break the capture."""
        capturing = is_capturing()
        if not capturing:
            self._read_timings()
        cost = self.stage_costs.get(stage, 0.0)
        with self._turn:
            while (paced and not capturing and not self._draining and not self._fresh
                   and (self._credit <= 0 or cost / 2 > self._credit)):
                self._waiting = True
                self._turn.notify_all()
                self._turn.wait_for(lambda: not self._waiting)
            if paced:
                self._credit -= cost
                self._fresh = False
        self._stage, self._stage_start = stage, self._marker()

    def _end_stage(self) -> None:
        end = self._marker()
        if self._stage_start is not None and end is not None:
            self._timings.append((self._stage, self._stage_start, end))
        self._stage_start = None

    def _marker(self) -> torch.cuda.Event | float | None:
        """A point in the current stream's work: an event (CUDA; none while a graph is being
        recorded) or the host clock (CPU, where work is done when issued)."""
        if self._own_stream is None:
            return time.perf_counter()
        if is_capturing():
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _read_timings(self) -> None:
        """Stage costs (ms) from the timings whose work has run."""
        while self._timings:
            stage, start, end = self._timings[0]
            if isinstance(end, float):
                cost = 1000 * (end - start)
            elif end.query():
                cost = start.elapsed_time(end)
            else:
                return
            self.stage_costs[stage] = cost
            self._timings.popleft()

    def _warm_push(self, image: torch.Tensor, timestamp: float) -> None:
        self.engine.push(image, timestamp)  # its predictions are not the stream's

    def _forget(self) -> None:
        self.engine.finish()
        self.engine.reset()
