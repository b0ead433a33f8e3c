"""The live state between the run loop and the viewer thread: the latest-wins hand-off, the pause, and the
viewer thread under supervision (models/supervision.py), as nerfstudio's render state machine keeps its
training thread apart from its renderer.

Two threads meet here, through a latest-wins state (models/supervision.py's `LatestState`). The inference
thread calls `on_frame`, which only merges the prediction into the pending map keyed by frame index (a
re-emitted frame overwrites its earlier emission) and returns. The viewer thread wakes at most `update_hz`
times a second, takes everything pending and hands it to the viewer's draw, which turns it into scene changes inside one `server.atomic()` block (scene.py). viser
sends from its own event loop, a task per browser, so a browser that stops reading holds neither thread.
The viewer thread is a helper of the run: if it raises, or an update runs past VIEWER_STALL_S, the viewer
is off for the rest of the run (one warning line) and the run goes on without it. The pause is an Event
that the run loop checks between frames (`wait_if_paused`); nothing ever holds it once the viewer is off.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import viser

from stream_recon.app.viewer.geometry import ChainCentre
from stream_recon.models import FramePrediction
from stream_recon.models.loops.corrections import ChunkCorrections
from stream_recon.models.supervision import (
    Deadline,
    Helper,
    HelperPolicy,
    LatestState,
    WhenDown,
    WhenFull,
    start_supervised_thread,
)

logger = logging.getLogger(__name__)

# An update that takes longer has stalled: the viewer is off for the rest of the run. The longest one with a
# reason draws a full pending map (max_pending, 256 keyframes) at ~15 ms a keyframe on a busy 2-core CPU
# (scene.py's docstring), about 4 s; five times that.
VIEWER_STALL_S = 20.0
# How long `close` waits for the viewer thread's last update (everything still pending): a full pending map
# takes about 4 s (above); one not done by then is left behind (a daemon) and the viewer is off.
VIEWER_CLOSE_S = 10.0
# How long stopping the web server may hold its caller: viser's own stop waits up to 6 s (1 s for its
# thread, then 5 s for its event loop) where a browser has stopped reading, for a close handshake that browser
# never answers; a healthy stop takes a few ms. Past this, it finishes on a daemon thread.
VIEWER_STOP_S = 2.0
# Latest wins: `on_frame` replaces a frame's pending prediction and keeps at most `max_pending`.
VIEWER_POLICY = HelperPolicy("the live viewer", WhenFull.LATEST, WhenDown.TURN_OFF, stall_s=VIEWER_STALL_S)
ARRIVAL_WINDOW_S = 2.0


@dataclass
class Pending:
    """What `on_frame` and the GUI hand to the viewer thread; guarded by LiveState's lock."""

    predictions: dict[int, FramePrediction] = field(default_factory=dict)
    poses: dict[int, ChainCentre] = field(default_factory=dict)  # frame index -> its camera centre
    corrections: ChunkCorrections | None = None  # the newest handed over
    truncate_after: int | None = None
    stats: dict = field(default_factory=dict)
    rebuild_clouds: bool = False
    last: bool = False  # the viewer's last update (it is closing): a cloud waiting for a token is drawn now

    @property
    def is_empty(self) -> bool:
        return not (
            self.predictions or self.poses or self.corrections is not None or self.truncate_after is not None
            or self.rebuild_clouds
        )


def _after_take(taken: Pending | None) -> Pending:
    """The pending state left when the viewer thread takes one: empty, the latest stats kept."""
    return Pending() if taken is None else Pending(stats=taken.stats)


class LiveState:
    """The pending updates, the pause and the viewer thread that calls `draw(pending, arrival_fps)` with
    each batch it takes, from `start` on (call it once whatever `draw` touches is built). `draw` returns the
    seconds after which it is to be called again though nothing new is pending (a keyframe's cloud waiting
    for the rate's token), or None. `policy`: the viewer thread's (None: VIEWER_POLICY); `close_s`: how long
    `close` waits for its last update (None: VIEWER_CLOSE_S). `library_threads`: the threads of the web server the viewer
    runs (its helper owns them)."""

    def __init__(self, draw: Callable[[Pending, float], float | None], *, update_hz: float,
                 max_pending: int, policy: HelperPolicy | None = None, close_s: float | None = None,
                 library_threads: Callable[[], list[threading.Thread]] | None = None) -> None:
        self.update_hz = update_hz
        self.max_pending = max_pending
        self.close_s = VIEWER_CLOSE_S if close_s is None else close_s
        self._draw = draw
        self._stopping = threading.Event()
        self._resume = threading.Event()
        self._resume.set()
        self.closed = False
        self._arrivals: collections.deque[float] = collections.deque(maxlen=512)
        self.busy_seconds = 0.0  # wall time the viewer thread spent drawing: its share of the run
        # Whatever the viewer thread raises turns the viewer off for the rest of the run (one warning line);
        # the run goes on without it.
        self.helper = Helper(VIEWER_POLICY if policy is None else policy, library_threads)
        self._latest: LatestState[Pending] = LatestState(self.helper, _after_take, lambda pending: pending.is_empty)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = start_supervised_thread(self.helper, self._run, "viewer")

    # ------------------------------------------------------------------------------- the hand-off

    def on_frame(self, pred: FramePrediction, stats: dict) -> None:
        if self.closed or not self.is_up:
            return

        def merge(pending: Pending) -> None:
            pending.predictions[pred.frame_index] = pred  # a re-emission replaces the earlier one
            if len(pending.predictions) > self.max_pending:
                # The viewer fell far behind: keep only the pose of the oldest pending frame, so the
                # trajectory stays whole while memory stays bounded.
                oldest = pending.predictions.pop(next(iter(pending.predictions)))
                pending.poses[oldest.frame_index] = ChainCentre.of(oldest.c2w, oldest.chunk_index)
            pending.stats = dict(stats)
            self._arrivals.append(time.perf_counter())

        self._latest.update(merge)

    def push_poses(self, c2w_by_frame: dict[int, np.ndarray], chunk_index: int) -> None:
        centres = {index: ChainCentre.of(c2w, chunk_index) for index, c2w in c2w_by_frame.items()}
        self._latest.update(lambda pending: pending.poses.update(centres))

    def queue_corrections(self, corrections: ChunkCorrections) -> None:
        if self.closed or not self.is_up:
            return

        def merge(pending: Pending) -> None:
            if pending.corrections is None or corrections.version > pending.corrections.version:
                pending.corrections = corrections

        self._latest.update(merge)

    def truncate_after(self, frame_index: int) -> None:
        def merge(pending: Pending) -> None:
            for index in [i for i in pending.predictions if i > frame_index]:
                del pending.predictions[index]
            for index in [i for i in pending.poses if i > frame_index]:
                del pending.poses[index]
            previous = pending.truncate_after
            pending.truncate_after = frame_index if previous is None else min(previous, frame_index)

        self._latest.update(merge)

    def request_rebuild(self) -> None:
        """Re-send every cloud in the next update (a setting they are built from changed)."""
        self._latest.update(lambda pending: setattr(pending, "rebuild_clouds", True))

    def wake(self) -> None:
        """Draw an update soon although nothing is pending (a display setting changed)."""
        self._latest.nudge()

    @property
    def num_pending(self) -> int:
        return self._latest.read(lambda pending: len(pending.predictions) + len(pending.poses))

    @property
    def num_updates(self) -> int:
        return self._latest.updates

    def flush(self, timeout: float) -> bool:
        """Wait until the viewer thread has drawn everything handed over, `timeout` s at most; False when it
        did not (or the viewer is off)."""
        return self.is_up and self._latest.wait_idle(Deadline(timeout))

    # ---------------------------------------------------------------------------- pause and health

    @property
    def is_up(self) -> bool:
        if self.helper.is_up and not self.helper.check(has_work=self._latest.working):
            self._resume.set()  # (off: nothing can resume a paused run any more)
        return self.helper.is_up

    @property
    def paused(self) -> bool:
        return not self._resume.is_set()

    def set_paused(self, paused: bool) -> None:
        if paused and not self.closed:
            self._resume.clear()
        else:
            self._resume.set()

    def wait_if_paused(self, timeout: float | None) -> bool:
        return not self.is_up or self._resume.wait(timeout)

    def close(self) -> None:
        """Let the viewer thread draw what is pending and end: `close_s` at most, then the viewer is off.
        Never leaves a run paused."""
        self.closed = True
        self._resume.set()  # a paused run must not hang at exit
        self._stopping.set()
        self._latest.close()
        if self.is_up:
            self._thread.join(timeout=self.close_s)
            if self._thread.is_alive():
                self.helper.fail(f"its last update did not finish within {self.close_s:g} s")

    # ----------------------------------------------------------------------------- the viewer thread

    def _run(self) -> None:
        """The viewer thread (supervised: whatever it raises turns the viewer off, and the run goes on)."""
        try:
            self._draw_until_stopped()
        except BaseException:
            self._resume.set()  # a paused run must not wait for a viewer that is gone
            logger.debug("the viewer's update failed", exc_info=True)  # (--verbose: where)
            raise

    def _draw_until_stopped(self) -> None:
        period = 1.0 / self.update_hz
        due = None
        while True:
            # (None: the viewer's own thread waits for its next update, holding no other thread)
            pending = self._latest.take(due)  # (an update's time counts toward a stall from here)
            started = time.perf_counter()
            pending.last = self._stopping.is_set()
            due = self._draw(pending, self._latest.read(lambda _: self._arrival_fps()))  # (on_frame appends)
            self._latest.done(more_due=due is not None)
            self.busy_seconds += time.perf_counter() - started
            if self._stopping.is_set() and self._latest.idle and due is None:
                return
            # Coalesce: whatever arrives during the rest of the period goes out in the next update.
            self._stopping.wait(max(0.0, period - (time.perf_counter() - started)))

    def _arrival_fps(self) -> float:
        """Frames per second over the last ARRIVAL_WINDOW_S seconds of `on_frame` calls.

        The denominator is at least one second: phase 1 hands over its scale frames in one burst, which
        would otherwise read as thousands of frames per second."""
        now = time.perf_counter()
        recent = [t for t in self._arrivals if now - t <= ARRIVAL_WINDOW_S]
        if not recent:
            return float("nan")
        return len(recent) / max(1.0, min(ARRIVAL_WINDOW_S, now - self._arrivals[0]))


def stop_server(server: viser.ViserServer, helper: Helper) -> None:
    """Stop the web server, holding the caller VIEWER_STOP_S at most (the stop goes on as `helper`'s thread)."""
    stopping = start_supervised_thread(helper, server.stop, "viewer-stop")
    stopping.join(timeout=VIEWER_STOP_S)


def web_server_threads(server: viser.ViserServer) -> list[threading.Thread]:
    """The threads viser runs for `server` now (they are the viewer's): its event loop's, its callbacks'
    pool's, and the loop's default executor's (name lookups). Read from viser's own attributes, since the
    library names none of them; one it no longer has is simply not listed."""
    websocket = getattr(server, "_websock_server", None)
    loop = getattr(server, "_event_loop", None)
    pools = (getattr(server, "_thread_executor", None), getattr(loop, "_default_executor", None))
    threads = [getattr(websocket, "_server_thread", None)]
    for pool in pools:
        threads += list(getattr(pool, "_threads", ()))
    return [thread for thread in threads if thread is not None]
