"""A run's clock: frame counts and the two rates the user cares about, the model's and the whole pipeline's.

    started ── model load ──▶ model_loaded() ── warm-up ── first push ──▶ ... frames ... ──▶ stop()
    |<------- model_load_s ------->|<- warm_up_s ->|
    |<----------------- until_first_frame_s ------------------>|<------ end-to-end FPS ------>|
    |<---------------------------------------- total_s ------------------------------------------>|

The warm-up (the engine's first streaming step compiled and recorded on copies of the first frame,
before the stream) is preparation, as the model load is: the stream's rate starts after it.

The rates are taken once, when the run stops, so that everything that reports them (run.json, the
final line, a batch's summary) reports the same number.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator


class RunClock:
    """Counts frames read and predicted, and the time spent loading, inside the engine and since the first frame."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.loaded_at: float | None = None
        self.first_frame_at: float | None = None
        self.stopped_at: float | None = None
        self.model_seconds = 0.0
        self.warm_up_s: float | None = None
        self.warm_up_parts: dict[str, float] | None = None  # the engine's warm_up: seconds by part
        self.frames_read = 0
        self.frames_done = 0  # distinct frames predicted: a chunked stream re-emits some frames
        # the run's keyframes so far, by frame index: a re-emitted frame's latest emission decides (the engine's own
        # count is its chunk's, from 0 at each rollover)
        self.keyframe_indices: set[int] = set()
        self._highest_index = -1

    def model_loaded(self) -> None:
        """The model and engine are ready: what came before is the load time."""
        self.loaded_at = time.perf_counter()

    def stop(self) -> None:
        """Freeze the end-to-end clock (idempotent): the run's rates are final from here on."""
        if self.stopped_at is None:
            self.stopped_at = time.perf_counter()

    def count_done(self, preds: list) -> None:
        for pred in preds:
            if pred.frame_index > self._highest_index:  # emissions of new frames come in index order
                self._highest_index = pred.frame_index
                self.frames_done += 1
            if pred.is_keyframe:
                self.keyframe_indices.add(pred.frame_index)
            else:
                self.keyframe_indices.discard(pred.frame_index)

    @contextlib.contextmanager
    def in_engine(self) -> Iterator[None]:
        """Time what the block does as engine time (a push, the end's parts); the first such block starts
        the end-to-end clock. A context, not a wrapper around the call: the frame's path stays in the run
        loop's own body (docs/ARCHITECTURE.md, "One frame's path")."""
        started = time.perf_counter()
        if self.first_frame_at is None:
            self.first_frame_at = started
        try:
            yield
        finally:
            self.model_seconds += time.perf_counter() - started

    def _now(self) -> float:
        return self.stopped_at if self.stopped_at is not None else time.perf_counter()

    @property
    def model_fps(self) -> float:
        return self.frames_done / self.model_seconds if self.model_seconds > 0 else float("nan")

    @property
    def end_to_end_fps(self) -> float:
        if self.first_frame_at is None:
            return float("nan")
        elapsed = self._now() - self.first_frame_at
        return self.frames_done / elapsed if elapsed > 0 else float("nan")

    def rates(self) -> dict[str, float | None]:
        return {"model_fps": finite_or_none(self.model_fps), "fps": finite_or_none(self.end_to_end_fps)}

    def timings(self) -> dict[str, float | None]:
        return {
            "total_s": round(self._now() - self.started, 3),
            "model_load_s": self._since_start(self.loaded_at),
            "until_first_frame_s": self._since_start(self.first_frame_at),
            "model_s": round(self.model_seconds, 3),
            "warm_up_s": None if self.warm_up_s is None else round(self.warm_up_s, 3),
            "warm_up_parts_s": self.warm_up_parts,
        }

    def _since_start(self, moment: float | None) -> float | None:
        return None if moment is None else round(moment - self.started, 3)


def finite_or_none(value: float | None) -> float | None:
    # JSON has no NaN: a run that produced no frame has no rate, not a NaN one.
    return value if value is not None and math.isfinite(value) else None
