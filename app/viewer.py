"""Live browser viewer (viser): watch the reconstruction grow while the stream runs.

Two threads meet here. The inference thread calls `on_frame`, which only drops the prediction into a
pending map keyed by frame index (a re-emitted frame overwrites its earlier emission) and returns. A
viewer thread wakes at most `update_hz` times a second, takes everything pending and turns it into scene
changes inside one `server.atomic()` block. viser's message buffer then coalesces repeated updates of a
node and keeps the current scene for browsers that join late, because nodes are updated through their
handles instead of being re-added. viser sends from its own event loop, a task per browser, so a browser
that stops reading holds neither thread. The viewer thread is a helper of the run (models/supervision.py):
if it raises, or an update runs past VIEWER_STALL_S, the viewer is off for the rest of the run (one warning
line) and the run goes on without it.

Scene tree (world = the model's frame, OpenCV axes, so the scene's up direction is -y):

    /chunks/2                    chunk 2's node: the rotation and translation of its loop-closure correction
    /chunks/2/f000123            posed parent: position + wxyz of keyframe 123's c2w (T_world_camera)
    /chunks/2/f000123/points     its point cloud in its own camera frame, float16, coloured by the frame
    /chunks/2/f000123/frustum    its frustum with a thumbnail of the frame
    /trajectory                  every camera centre seen so far, in frame order, as one line-segment node
    /current                     the newest camera, highlighted
    /loops                       one segment per accepted loop, between its two cameras

Because points live in their camera's frame, a pose correction (chunked streams re-emit frames aligned
into chunk 0's frame) moves one parent node and never re-sends points unless the depth itself changed.
A keyframe hangs under the node of the chunk that emitted it last, in the open chain's coordinates, so
a loop closure (`apply_corrections`) moves one node per chunk. viser's nodes carry no scale, so a chunk
whose correction scales it holds its keyframes' positions and points multiplied by that scale; the
trajectory, the current camera and the loop segments live in the corrected world itself.

Caps that keep the browser smooth over long runs: at most `max_points_per_keyframe` points per cloud, at
most `max_keyframes` keyframe nodes, at most `max_total_points` points in total. Over the total, the oldest
keyframes are first thinned to a quarter of their points, then removed (see `allocate_point_budget`).

Cost, measured on a 2-core CPU shared with other jobs (load average 8-11), frames at the model's input
size (378 x 518), every frame a keyframe, default caps: 1000 `on_frame` calls take about 4 ms in all,
with no browser or with one that never reads. The viewer thread spends about 15 ms per keyframe (half in
viser creating scene nodes, a quarter in sampling points), i.e. about half of one core at 30 keyframes
per second; `scene_summary()["busy_seconds"]` reports it for any run.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import cv2
import numpy as np
import viser

from stream_recon.app.options import VIEWER_HOST, VIEWER_PORT
from stream_recon.models.loops.corrections import ChunkCorrections
from stream_recon.models.stream.pose import back_project, rotation_to_quat_xyzw
from stream_recon.models.stream.prediction import FramePrediction
from stream_recon.models.stream.similarity import Sim3
from stream_recon.models.supervision import Helper, HelperPolicy, WhenDown, WhenFull, start_supervised_thread

logger = logging.getLogger(__name__)

# An update that takes longer has stalled: the viewer is off for the rest of the run. The longest one with a
# reason draws a full pending map (max_pending, 256 keyframes) at ~15 ms a keyframe on a busy 2-core CPU
# (module docstring), about 4 s; five times that.
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

# An old keyframe over the total-point cap keeps this share of its points before it is removed.
THINNED_FRACTION = 4
KEYFRAME_COLOR = (90, 90, 90)
CURRENT_COLOR = (255, 120, 0)
TRAJECTORY_COLOR = (255, 60, 60)
LOOP_COLOR = (0, 170, 255)
# A chunk scale within 1e-4 of 1 is drawn unscaled: 0.1 mm at 1 m, far below the points' spacing, and
# not worth re-sending every cloud of the chunk.
SCALE_TOLERANCE = 1e-4
ARRIVAL_WINDOW_S = 2.0


def allocate_point_budget(full_counts: list[int], max_total_points: int) -> list[int]:
    """Points to show per keyframe, oldest first, so that the sum stays within `max_total_points`.

    Each keyframe has two levels, full and thinned (full // THINNED_FRACTION, at least 1), and 0 means
    removed.
    Only two levels, so that a keyframe is re-sent at most once (smaller) before it disappears. Older
    keyframes are thinned first, then removed oldest first; the newest keyframe always stays whole.

        full_counts = [8, 8, 8, 8], max_total_points = 20  ->  [2, 2, 8, 8]
        full_counts = [8, 8, 8, 8], max_total_points = 12  ->  [0, 2, 2, 8]
    """
    counts = list(full_counts)
    excess = sum(counts) - max_total_points
    older = range(len(counts) - 1)
    for i in older:
        if excess <= 0:
            return counts
        thinned = max(1, counts[i] // THINNED_FRACTION)
        excess -= counts[i] - thinned
        counts[i] = thinned
    for i in older:
        if excess <= 0:
            break
        excess -= counts[i]
        counts[i] = 0
    return counts


@dataclass(frozen=True)
class KeyframeSample:
    """A keyframe's points, drawn once in random order so that any prefix is a uniform subsample.

    points [N, 3] float16 in the keyframe's camera frame; colors [N, 3] uint8; confidence [N] float32.
    """

    points: np.ndarray
    colors: np.ndarray
    confidence: np.ndarray

    @property
    def num_points(self) -> int:
        return int(self.points.shape[0])


def sample_keyframe_points(pred: FramePrediction, max_points: int) -> KeyframeSample:
    """Back-project up to `max_points` random valid pixels of a keyframe into its own camera frame.

    Only the sampled pixels are lifted (models.stream.pose.back_project, in float64 before the float16 the
    viewer sends): a full back-projection costs ~20x more at 518 x 378.
    """
    depth = np.asarray(pred.depth, dtype=np.float32)
    valid = np.flatnonzero(np.isfinite(depth) & (depth > 0))
    # Seeded by the frame index, so the same frame always shows the same points (stable re-emissions).
    rng = np.random.default_rng(pred.frame_index)
    if valid.size > max_points:
        chosen = rng.choice(valid, size=max_points, replace=False)
    else:
        chosen = rng.permutation(valid)
    h, w = depth.shape
    v, u = np.divmod(chosen, w)
    z = depth.reshape(-1)[chosen]
    x, y = back_project(u, v, z, pred.intrinsics, np.float64)
    points = np.stack([x, y, z], axis=-1).astype(np.float16)  # [N, 3]
    colors = _pixel_colors(pred, depth)[v, u]  # [N, 3]
    confidence = np.asarray(pred.depth_conf, dtype=np.float32).reshape(-1)[chosen]
    return KeyframeSample(points, np.ascontiguousarray(colors), confidence)


def _pixel_colors(pred: FramePrediction, depth: np.ndarray) -> np.ndarray:
    """[H, W, 3] uint8: the frame itself, or a depth colour map when the prediction carries no image."""
    if pred.image is not None and pred.image.shape[:2] == depth.shape:
        return np.asarray(pred.image, dtype=np.uint8)
    finite = depth[np.isfinite(depth) & (depth > 0)]
    near, far = np.percentile(finite, [2, 98]) if finite.size else (0.0, 1.0)
    scaled = np.clip((depth - near) / max(far - near, 1e-6), 0, 1)
    gray = (255 * (1 - np.nan_to_num(scaled))).astype(np.uint8)
    return cv2.cvtColor(cv2.applyColorMap(gray, cv2.COLORMAP_TURBO), cv2.COLOR_BGR2RGB)


MAX_CONFIDENCE_SLIDER = 10.0  # confidences above this are rare: a point that confident is kept anyway


def thumbnail(image: np.ndarray, max_side: int) -> np.ndarray:
    """Shrink [H, W, 3] uint8 so its longer side is at most `max_side` pixels."""
    h, w = image.shape[:2]
    factor = max_side / max(h, w)
    if factor >= 1:
        return np.ascontiguousarray(image)
    size = (max(1, round(w * factor)), max(1, round(h * factor)))
    return cv2.resize(image, size, interpolation=cv2.INTER_AREA)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)


def _format_number(value: float) -> str:
    return f"{value:.1f}" if math.isfinite(value) else "-"


def _depth_fingerprint(pred: FramePrediction) -> int:
    """Cheap identity of a prediction's geometry, to tell a pure pose correction from new depth."""
    crc = zlib.crc32(np.ascontiguousarray(pred.depth, dtype=np.float32).tobytes())
    return zlib.crc32(np.ascontiguousarray(pred.intrinsics, dtype=np.float32).tobytes(), crc)


def _field_of_view(pred: FramePrediction) -> tuple[float, float]:
    """(vertical field of view in radians, width / height) of the model input, for a viser frustum."""
    h, w = pred.image_size
    return 2 * math.atan2(h / 2, float(pred.intrinsics[1, 1])), w / h


def _pose(c2w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """c2w [3, 4] -> (wxyz [4], position [3]) for a viser node whose children live in camera axes."""
    c2w = np.asarray(c2w, dtype=np.float64)
    return np.roll(rotation_to_quat_xyzw(c2w[:3, :3]), 1), c2w[:3, 3].copy()


def _node_scale(transform: Sim3) -> float:
    """The factor between a chunk node's local coordinates and the chain's: the correction's scale, or 1
    within SCALE_TOLERANCE."""
    return float(transform.scale) if abs(transform.scale - 1.0) > SCALE_TOLERANCE else 1.0


def _keyframe_name(chunk_index: int, frame_index: int) -> str:
    return f"/chunks/{chunk_index}/f{frame_index:06d}"


@dataclass(frozen=True)
class _ChainCentre:
    """A camera centre [3] as its latest emission placed it in the open chain, and the emitting chunk."""

    chunk_index: int
    centre: np.ndarray


@dataclass
class _ChunkNode:
    """Server-side record of one chunk's node."""

    handle: Any  # viser.FrameHandle at the rotation and translation of the chunk's correction
    scale: float = 1.0  # its children's coordinates are this times the chain's (`_node_scale`)


@dataclass
class _Keyframe:
    """Server-side record of one keyframe on screen."""

    frame_index: int
    chunk_index: int
    centre: np.ndarray  # [3] its camera centre in the open chain
    sample: KeyframeSample
    fingerprint: int
    parent: Any  # viser.FrameHandle
    frustum: Any  # viser.CameraFrustumHandle
    cloud: Any = None  # viser.PointCloudHandle
    shown_count: int = 0  # prefix of `sample` currently on screen (before the confidence filter)
    shown_settings: tuple = ()  # (min. confidence, budget, chunk scale) the cloud was built with


@dataclass
class _Pending:
    """What `on_frame` and the GUI hand to the viewer thread; guarded by LiveViewer._lock."""

    predictions: dict[int, FramePrediction] = field(default_factory=dict)
    poses: dict[int, _ChainCentre] = field(default_factory=dict)  # frame index -> its camera centre
    corrections: ChunkCorrections | None = None  # the newest handed over
    truncate_after: int | None = None
    stats: dict = field(default_factory=dict)
    rebuild_clouds: bool = False


class LiveViewer:
    """A viser server showing the stream as it is reconstructed; a sink for the run loop.

    Usage (the run loop):

        viewer = LiveViewer()
        print(viewer.url)
        for ...:
            viewer.wait_if_paused()
            for pred in engine.push(image, timestamp=t):
                viewer.on_frame(pred, engine.stats())
        viewer.close("complete")
    """

    def __init__(
        self,
        host: str | None = VIEWER_HOST,
        port: int | None = VIEWER_PORT,
        *,
        max_points_per_keyframe: int = 20_000,
        max_total_points: int = 2_000_000,
        max_keyframes: int = 300,
        points_per_keyframe: int | None = None,
        min_confidence: float = 1.0,  # as --conf-threshold: confidence is 1 + exp(logit), so 1 keeps every point
        update_hz: float = 4.0,
        max_new_clouds_per_second: float | None = None,
        thumbnail_px: int = 96,  # longer side of the frustum thumbnails; 0 for none
        max_pending: int = 256,
        keep_serving: bool = False,
        inference_controls: bool = True,
        label: str = "stream-recon",
    ) -> None:
        if max_points_per_keyframe < 1 or max_total_points < max_points_per_keyframe:
            raise ValueError(
                f"viewer caps are inconsistent: max_points_per_keyframe={max_points_per_keyframe} must be "
                f">= 1 and <= max_total_points={max_total_points}"
            )
        self.max_points_per_keyframe = max_points_per_keyframe
        self.max_total_points = max_total_points
        self.max_keyframes = max_keyframes
        self.update_hz = update_hz
        # New keyframe clouds the scene takes per second, on average (bursts up to one second's worth;
        # None: every keyframe). A live run sets it: with every frame a keyframe at 40 FPS, a cloud per
        # keyframe keeps the viewer thread busy ~29 ms per frame with a browser connected
        # (scripts/bench_e2e.py measures it), Python work that competes with the stream's for the
        # interpreter. Frames 25 ms apart show nearly the same points; the skipped ones still extend
        # the trajectory, and points.ply keeps every frame.
        self.max_new_clouds_per_second = max_new_clouds_per_second
        self._cloud_tokens = max_new_clouds_per_second or 0.0
        self._tokens_at = time.perf_counter()
        self.thumbnail_px = thumbnail_px
        self.max_pending = max_pending
        self.keep_serving = keep_serving

        # viser binds 0.0.0.0 unless told otherwise (and websockets reads host=None as every interface),
        # so "not given" means loopback here. viser walks to the next free port when one is taken.
        host = host or VIEWER_HOST
        port = VIEWER_PORT if port is None else port
        self.server = viser.ViserServer(host=host, port=port, label=label, verbose=False)
        self.host = host
        self.port = self.server.get_port()
        self.url = f"http://{host}:{self.port}"
        self.server.scene.set_up_direction("-y")

        # Display settings: written by GUI callbacks (viser's thread pool), read by the viewer thread.
        self._points_per_keyframe = min(
            points_per_keyframe or max_points_per_keyframe, max_points_per_keyframe
        )
        self._min_confidence = float(min_confidence)
        self._point_size_factor = 1.0
        self._show_all = True
        self._last_n = min(50, max_keyframes)
        self._follow = False

        self._lock = threading.Lock()
        self._pending = _Pending()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._resume = threading.Event()
        self._resume.set()
        self._closed = False
        self._drawing = False  # the viewer thread is applying a batch it took from `_pending`
        self._arrivals: collections.deque[float] = collections.deque(maxlen=512)

        # Scene state, touched only by the viewer thread.
        self._keyframes: dict[int, _Keyframe] = {}
        self._centres: dict[int, _ChainCentre] = {}  # every frame seen, keyframe or not
        self._chunks: dict[int, _ChunkNode] = {}
        self._corrections = ChunkCorrections(by_chunk={}, version=-1)  # the last applied; -1: none yet
        self._loop_edges = None
        self._loop_segments = np.zeros((0, 2, 3), np.float32)
        self._evicted_up_to = -1  # keyframes at or below this index were dropped by the caps
        self._scene_scale: float | None = None
        self._trajectory = None
        self._current = None
        self._current_index = -1
        self._current_chunk = 0
        self._current_chain_c2w: np.ndarray | None = None  # as emitted, in the open chain
        self._current_c2w: np.ndarray | None = None  # corrected
        self._num_updates = 0
        self._busy_seconds = 0.0  # wall time the viewer thread spent drawing: its share of the run

        self._build_gui(inference_controls)
        # Whatever the viewer thread raises turns the viewer off for the rest of the run (one warning line);
        # the run goes on without it.
        self.helper = Helper(VIEWER_POLICY)
        self._thread = start_supervised_thread(self.helper, self._run, "viewer")

    # ----------------------------------------------------------------------------------------- sink API

    def on_frame(self, pred: FramePrediction, stats: dict) -> None:
        """Queue one prediction for display; O(1), never waits for the browser or the viewer thread. Nothing
        once the viewer is off (its thread raised, or an update ran past VIEWER_STALL_S)."""
        if self._closed or not self.is_up:
            return
        with self._lock:
            pending = self._pending
            pending.predictions[pred.frame_index] = pred  # a re-emission replaces the earlier one
            if len(pending.predictions) > self.max_pending:
                # The viewer fell far behind: keep only the pose of the oldest pending frame, so the
                # trajectory stays whole while memory stays bounded.
                oldest = pending.predictions.pop(next(iter(pending.predictions)))
                pending.poses[oldest.frame_index] = _ChainCentre(
                    oldest.chunk_index, np.array(oldest.c2w, dtype=np.float32)[:3, 3]
                )
            pending.stats = dict(stats)
            self._arrivals.append(time.perf_counter())
        self._wake.set()

    @property
    def is_up(self) -> bool:
        """Whether the viewer still draws: not off after its thread raised or an update stalled."""
        if self.helper.is_up and not self.helper.check(has_work=self._drawing):
            self._resume.set()  # (off: nothing can resume a paused run any more)
        return self.helper.is_up

    def record(self) -> dict:
        """What run.json says of the viewer (models/supervision.py's record: up, and why not)."""
        return self.helper.record()

    def close(self, status: str = "complete") -> None:
        """Show the last state (VIEWER_CLOSE_S at most), stop the viewer thread and, unless `keep_serving`,
        the server."""
        if self._closed:
            return
        self._closed = True
        self._resume.set()  # a paused run must not hang at exit
        self._stopping.set()
        self._wake.set()
        if self.is_up:
            self._thread.join(timeout=VIEWER_CLOSE_S)
            if self._thread.is_alive():
                self.helper.fail(f"its last update did not finish within {VIEWER_CLOSE_S:g} s")
        try:
            self._status.content = f"**run {status}**"
            if self._pause_button is not None:
                self._pause_button.disabled = True
        except RuntimeError:
            pass
        if not self.keep_serving:
            self.stop()

    def set_status(self, text: str) -> None:
        """The status line at the top of the GUI panel (markdown)."""
        self._status.content = text

    def stop(self) -> None:
        """Stop the web server (after `close`, when the viewer was kept serving); VIEWER_STOP_S at most."""
        stopping = threading.Thread(target=self.server.stop, name="viewer-stop", daemon=True)
        stopping.start()
        stopping.join(timeout=VIEWER_STOP_S)

    def __enter__(self) -> LiveViewer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("complete" if exc_type is None else "failed")

    # ---------------------------------------------------------------------------- run-loop controls

    @property
    def paused(self) -> bool:
        return not self._resume.is_set()

    def set_paused(self, paused: bool) -> None:
        if paused and not self._closed:
            self._resume.clear()
        else:
            self._resume.set()
        if self._pause_button is not None:
            self._pause_button.label = "Resume inference" if paused else "Pause inference"

    def wait_if_paused(self, timeout: float | None = None) -> bool:
        """Block the calling (inference) thread while the browser has paused the run (never once the
        viewer is off).

        Returns False when `timeout` ran out while still paused."""
        return not self.is_up or self._resume.wait(timeout)

    # ------------------------------------------------------------------------------- replay controls

    def push_poses(self, c2w_by_frame: dict[int, np.ndarray], chunk_index: int = 0) -> None:
        """Queue camera poses only (no points), e.g. a replay's trajectory up to the timeline position;
        a correction moves them as chunk `chunk_index`'s emissions."""
        centres = {
            index: _ChainCentre(chunk_index, np.array(c2w, dtype=np.float32)[:3, 3])
            for index, c2w in c2w_by_frame.items()
        }
        with self._lock:
            self._pending.poses.update(centres)
        self._wake.set()

    def apply_corrections(self, corrections: ChunkCorrections) -> None:
        """Queue a solved pose graph: each chunk's node moves by its correction, and the accepted loops
        are drawn. One whose version is not newer than the last applied or queued one is ignored."""
        if self._closed or not self.is_up:
            return
        with self._lock:
            queued = self._pending.corrections
            if queued is None or corrections.version > queued.version:
                self._pending.corrections = corrections
        self._wake.set()

    def truncate_after(self, frame_index: int) -> None:
        """Forget every frame after `frame_index` (a replay's timeline moved back); queued like a frame."""
        with self._lock:
            pending = self._pending
            for index in [i for i in pending.predictions if i > frame_index]:
                del pending.predictions[index]
            for index in [i for i in pending.poses if i > frame_index]:
                del pending.poses[index]
            previous = pending.truncate_after
            pending.truncate_after = frame_index if previous is None else min(previous, frame_index)
        self._wake.set()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is on the scene (tests, replay seeks)."""
        target = self._num_updates + 1
        self._wake.set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.is_up:
            with self._lock:
                idle = self._pending_is_empty() and not self._drawing
            if idle and self._num_updates >= target:
                return True
            self._wake.set()
            time.sleep(0.01)
        return False

    def shown_keyframes(self) -> set[int]:
        """Frame indices of the keyframes on screen (as of the last viewer update)."""
        return set(list(self._keyframes))

    @property
    def num_pending(self) -> int:
        """Frames queued and not yet drawn: at most `max_pending` predictions, plus the poses of any
        frames that overflowed (a few floats each)."""
        with self._lock:
            return len(self._pending.predictions) + len(self._pending.poses)

    def scene_summary(self) -> dict:
        """What is on screen (keyframes, scene nodes this viewer owns, points, trajectory length) and the
        viewer thread's cost (updates drawn, seconds spent drawing them)."""
        keyframes = list(self._keyframes.values())  # a copy: the viewer thread may be adding to it
        clouds = [kf.cloud for kf in keyframes if kf.cloud is not None]
        own_nodes = 3 * len(keyframes) + len(self._chunks)
        own_nodes += sum(node is not None for node in (self._trajectory, self._current, self._loop_edges))
        return {
            "keyframes": len(keyframes),
            "nodes": own_nodes,
            "points": int(sum(c.points.shape[0] for c in clouds)),
            "trajectory_frames": len(self._centres),
            "current_frame": self._current_index,
            "updates": self._num_updates,
            "busy_seconds": round(self._busy_seconds, 3),
        }

    # ------------------------------------------------------------------------------------- internals

    def _pending_is_empty(self) -> bool:
        p = self._pending
        return not (
            p.predictions or p.poses or p.corrections is not None or p.truncate_after is not None
            or p.rebuild_clouds
        )

    def _request_rebuild(self) -> None:
        with self._lock:
            self._pending.rebuild_clouds = True
        self._wake.set()

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
        while True:
            self._wake.wait()  # unbounded-ok: the viewer's own thread waits for its next update
            self._wake.clear()
            started = time.perf_counter()
            self.helper.beat()  # (an update's time counts toward a stall from here)
            self._apply_pending()
            self.helper.beat()
            with self._lock:
                self._drawing = False
            self._num_updates += 1
            self._busy_seconds += time.perf_counter() - started
            with self._lock:
                done = self._stopping.is_set() and self._pending_is_empty()
            if done:
                return
            # Coalesce: whatever arrives during the rest of the period goes out in the next update.
            self._stopping.wait(max(0.0, period - (time.perf_counter() - started)))

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, _Pending(stats=self._pending.stats)
            self._drawing = True
            fps = self._arrival_fps()
        with self.server.atomic():
            if pending.truncate_after is not None:
                self._truncate(pending.truncate_after)
            self._centres.update(pending.poses)
            if pending.corrections is not None:
                self._apply_corrections(pending.corrections)
            drawn = self._new_clouds_allowed(pending.predictions)
            for index in sorted(pending.predictions):
                self._apply_prediction(pending.predictions[index], draw_cloud=index in drawn)
            self._enforce_caps(rebuild_all=pending.rebuild_clouds)
            self._apply_visibility()
            self._update_trajectory()
            self._update_loop_edges()
        if pending.predictions:
            self._update_current(pending.predictions[max(pending.predictions)])
        elif pending.corrections is not None:
            self._place_current()
        self._update_readouts(pending.stats, fps)

    def _arrival_fps(self) -> float:
        """Frames per second over the last ARRIVAL_WINDOW_S seconds of `on_frame` calls.

        The denominator is at least one second: phase 1 hands over its scale frames in one burst, which
        would otherwise read as thousands of frames per second."""
        now = time.perf_counter()
        recent = [t for t in self._arrivals if now - t <= ARRIVAL_WINDOW_S]
        if not recent:
            return float("nan")
        return len(recent) / max(1.0, min(ARRIVAL_WINDOW_S, now - self._arrivals[0]))

    def _truncate(self, frame_index: int) -> None:
        for index in [i for i in self._keyframes if i > frame_index]:
            self._remove_keyframe(index)
        for index in [i for i in self._centres if i > frame_index]:
            del self._centres[index]
        # Keyframes dropped by the caps may fit again once the newer ones are gone.
        self._evicted_up_to = -1
        if self._current_index > frame_index:
            self._current_index = -1

    def _new_clouds_allowed(self, predictions: dict[int, FramePrediction]) -> set[int]:
        """Which of these new keyframes get a cloud: all while the token bucket holds enough, else as
        many as it holds, spread evenly over them and always the newest."""
        rate = self.max_new_clouds_per_second
        if rate is None:
            return set(predictions)
        now = time.perf_counter()
        self._cloud_tokens = min(rate, self._cloud_tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        new = [i for i in sorted(predictions) if predictions[i].is_keyframe and i not in self._keyframes
               and i > self._evicted_up_to]
        allowed = int(self._cloud_tokens)
        if len(new) > allowed:
            new = [new[round(k)] for k in np.linspace(len(new) - 1, 0, allowed)] if allowed else []
        self._cloud_tokens -= len(new)
        return set(new)

    def _apply_corrections(self, corrections: ChunkCorrections) -> None:
        if corrections.version <= self._corrections.version:
            return
        self._corrections = corrections
        for chunk_index, node in self._chunks.items():
            self._place_chunk(chunk_index, node)

    def _place_chunk(self, chunk_index: int, node: _ChunkNode) -> None:
        """Pose the chunk's node by its correction; a new scale moves its keyframes' parents here and
        re-sends their clouds in `_enforce_caps` (their settings no longer match)."""
        transform = self._corrections.for_chunk(chunk_index)
        node.handle.wxyz, node.handle.position = _pose(transform.matrix)  # its rotation and translation
        scale = _node_scale(transform)
        if scale == node.scale:
            return
        node.scale = scale
        for keyframe in self._keyframes.values():
            if keyframe.chunk_index == chunk_index:
                keyframe.parent.position = scale * keyframe.centre.astype(np.float64)

    def _chunk_node(self, chunk_index: int) -> _ChunkNode:
        node = self._chunks.get(chunk_index)
        if node is None:
            node = _ChunkNode(self.server.scene.add_frame(f"/chunks/{chunk_index}", show_axes=False))
            self._chunks[chunk_index] = node
            if not self._corrections.is_identity:
                self._place_chunk(chunk_index, node)
        return node

    def _apply_prediction(self, pred: FramePrediction, draw_cloud: bool = True) -> None:
        index = pred.frame_index
        self._centres[index] = _ChainCentre(pred.chunk_index, np.asarray(pred.c2w, dtype=np.float32)[:3, 3])
        existing = self._keyframes.get(index)
        if not pred.is_keyframe:
            if existing is not None:  # re-emitted as a non-keyframe: it no longer belongs in the map
                self._remove_keyframe(index)
            return
        if existing is None:
            if index > self._evicted_up_to and draw_cloud:
                self._add_keyframe(pred)
            return
        fingerprint = _depth_fingerprint(pred)
        if fingerprint != existing.fingerprint or pred.chunk_index != existing.chunk_index:
            self._remove_keyframe(index)  # new depth, or the node of the chunk that emitted it now
            self._add_keyframe(pred, fingerprint)
            return
        wxyz, position = _pose(pred.c2w)
        existing.centre = position.astype(np.float32)
        existing.parent.wxyz = wxyz
        existing.parent.position = self._chunks[existing.chunk_index].scale * position

    def _add_keyframe(self, pred: FramePrediction, fingerprint: int | None = None) -> None:
        sample = sample_keyframe_points(pred, self.max_points_per_keyframe)
        if self._scene_scale is None and sample.num_points:
            self._scene_scale = float(np.median(sample.points[:, 2].astype(np.float32)))
            self._reset_view()
        wxyz, position = _pose(pred.c2w)
        chunk = self._chunk_node(pred.chunk_index)
        name = _keyframe_name(pred.chunk_index, pred.frame_index)
        parent = self.server.scene.add_frame(name, show_axes=False, wxyz=wxyz, position=chunk.scale * position)
        fov_y, aspect = _field_of_view(pred)
        frustum = self.server.scene.add_camera_frustum(
            f"{name}/frustum",
            fov=fov_y,
            aspect=aspect,
            scale=self._frustum_scale(),
            thickness=1.5,
            thickness_units="screen",
            color=KEYFRAME_COLOR,
            image=self._thumbnail(pred),
            format="jpeg",
            jpeg_quality=70,
        )
        self._keyframes[pred.frame_index] = _Keyframe(
            frame_index=pred.frame_index,
            chunk_index=pred.chunk_index,
            centre=position.astype(np.float32),
            sample=sample,
            fingerprint=_depth_fingerprint(pred) if fingerprint is None else fingerprint,
            parent=parent,
            frustum=frustum,
        )

    def _remove_keyframe(self, index: int) -> None:
        keyframe = self._keyframes.pop(index)
        keyframe.parent.remove()  # takes the cloud and the frustum with it

    def _enforce_caps(self, rebuild_all: bool) -> None:
        order = sorted(self._keyframes)  # oldest first: frame order, not arrival order
        for index in order[: max(0, len(order) - self.max_keyframes)]:
            self._evicted_up_to = max(self._evicted_up_to, index)
            self._remove_keyframe(index)
        order = sorted(self._keyframes)
        budget = self._points_per_keyframe
        full = [min(budget, self._keyframes[i].sample.num_points) for i in order]
        counts = allocate_point_budget(full, self.max_total_points)
        for index, count in zip(order, counts, strict=True):
            keyframe = self._keyframes[index]
            if count == 0:
                self._evicted_up_to = max(self._evicted_up_to, index)
                self._remove_keyframe(index)
            elif rebuild_all or count != keyframe.shown_count or self._settings_changed(keyframe):
                self._show_cloud(keyframe, count)
            elif keyframe.cloud is not None:
                keyframe.cloud.point_size = self._point_size()

    def _cloud_settings(self, keyframe: _Keyframe) -> tuple:
        """What a keyframe's cloud is built from besides its sample: a change re-sends it."""
        return self._min_confidence, self._points_per_keyframe, self._chunks[keyframe.chunk_index].scale

    def _settings_changed(self, keyframe: _Keyframe) -> bool:
        return self._cloud_settings(keyframe) != keyframe.shown_settings

    def _show_cloud(self, keyframe: _Keyframe, count: int) -> None:
        points = keyframe.sample.points[:count]
        colors = keyframe.sample.colors[:count]
        confidence = keyframe.sample.confidence[:count]
        if self._min_confidence > 1.0:  # the rule of --conf-threshold and points.ply, not a percentile
            keep = confidence >= self._min_confidence
            points, colors = points[keep], colors[keep]
        scale = self._chunks[keyframe.chunk_index].scale
        if scale != 1.0:
            points = (scale * points.astype(np.float32)).astype(np.float16)
        # Same-name re-add replaces the node (and its buffered create message) in one step; assigning
        # points and colours separately would briefly pair arrays of different lengths on the client.
        keyframe.cloud = self.server.scene.add_point_cloud(
            f"{keyframe.parent.name}/points",
            points=points,
            colors=colors,
            point_size=self._point_size(),
            point_shape="square",
            precision="float16",
            point_shading="flat",
        )
        keyframe.shown_count = count
        keyframe.shown_settings = self._cloud_settings(keyframe)

    def _apply_visibility(self) -> None:
        newest_first = sorted(self._keyframes, reverse=True)
        for rank, index in enumerate(newest_first):
            self._keyframes[index].parent.visible = self._show_all or rank < self._last_n

    def _corrected_centres(self, indices: list[int]) -> np.ndarray:
        """[S, 3] float32: the camera centres of these frames, each moved by its chunk's correction."""
        centres = np.stack([self._centres[i].centre for i in indices]).astype(np.float64)
        if self._corrections.is_identity:
            return centres.astype(np.float32)
        chunks = np.array([self._centres[i].chunk_index for i in indices])
        for chunk_index in np.unique(chunks):
            moved = chunks == chunk_index
            centres[moved] = self._corrections.for_chunk(int(chunk_index)).apply_to_points(centres[moved])
        return centres.astype(np.float32)

    def _update_trajectory(self) -> None:
        if len(self._centres) < 2:
            return
        centres = self._corrected_centres(sorted(self._centres))  # [S, 3]
        segments = np.stack([centres[:-1], centres[1:]], axis=1)  # [S - 1, 2, 3]
        if self._trajectory is None:
            self._trajectory = self.server.scene.add_line_segments(
                "/trajectory", segments, colors=TRAJECTORY_COLOR, thickness=2.0, thickness_units="screen"
            )
        else:
            self._trajectory.points = segments

    def _update_loop_edges(self) -> None:
        """One segment per accepted loop whose two frames this viewer has seen, between their corrected
        camera centres; re-sent only when they change."""
        pairs = [(loop.query_frame, loop.candidate_frame) for loop in self._corrections.accepted_loops
                 if loop.query_frame in self._centres and loop.candidate_frame in self._centres]
        if pairs:
            ends = self._corrected_centres([frame for pair in pairs for frame in pair])
            segments = ends.reshape(len(pairs), 2, 3)
        else:
            segments = np.zeros((0, 2, 3), np.float32)
        if np.array_equal(segments, self._loop_segments):
            return
        self._loop_segments = segments
        if pairs:  # a same-name re-add replaces the node, its colours sized to the new segments
            self._loop_edges = self.server.scene.add_line_segments(
                "/loops", segments, colors=LOOP_COLOR, thickness=3.0, thickness_units="screen"
            )
        elif self._loop_edges is not None:
            self._loop_edges.remove()
            self._loop_edges = None

    def _place_current(self) -> None:
        """Put the current camera where the last applied correction moves it."""
        if self._current is None or self._current_chain_c2w is None:
            return
        self._current_c2w = self._corrections.corrected_c2w(self._current_chunk, self._current_chain_c2w)
        self._current.wxyz, self._current.position = _pose(self._current_c2w)
        if self._follow:
            self._move_clients_to(self._current_c2w)

    def _update_current(self, pred: FramePrediction) -> None:
        if pred.frame_index < self._current_index:
            return
        self._current_index = pred.frame_index
        self._current_chunk = pred.chunk_index
        self._current_chain_c2w = np.asarray(pred.c2w, dtype=np.float64)
        self._current_c2w = self._corrections.corrected_c2w(pred.chunk_index, self._current_chain_c2w)
        wxyz, position = _pose(self._current_c2w)
        thumb = self._thumbnail(pred)
        fov_y, aspect = _field_of_view(pred)
        with self.server.atomic():
            if self._current is None:
                self._current = self.server.scene.add_camera_frustum(
                    "/current",
                    fov=fov_y,
                    aspect=aspect,
                    scale=1.6 * self._frustum_scale(),
                    thickness=4.0,
                    thickness_units="screen",
                    color=CURRENT_COLOR,
                    image=thumb,
                    format="jpeg",
                    jpeg_quality=70,
                    wxyz=wxyz,
                    position=position,
                )
            else:
                self._current.wxyz = wxyz
                self._current.position = position
                if thumb is not None:
                    self._current.image = thumb
        if pred.image is not None:
            self._frame_image.image = thumbnail(pred.image, 320)
        # a frame saved without its image (--no-save-images) shows none, rather than a stale or black one
        self._frame_image.visible = pred.image is not None
        if self._follow:
            self._move_clients_to(self._current_c2w)

    def _update_readouts(self, stats: dict, arrival_fps: float) -> None:
        """The frame on screen, and for a live run its rates and cache, from the run loop's stats (any key
        may be missing or None). A replay passes no stats: it has no frame rate of its own to show."""
        line = f"frame **{self._current_index}**"
        if "fps" in stats:  # a live run: the run loop's rate, or the frames' arrival rate until it has one
            fps = stats["fps"] if _is_number(stats["fps"]) else arrival_fps
            line += f", FPS **{_format_number(fps)}**"
            if _is_number(stats.get("model_fps")):
                line += f" (model {_format_number(stats['model_fps'])})"
        lines = [
            line,
            f"keyframes on screen {len(self._keyframes)}, points {self.scene_summary()['points']:,}",
        ]
        if _is_number(stats.get("patch_frames")):  # the frames attention reads in full: scale + window
            memory = f", {stats['cache_bytes'] / 2**20:.1f} MiB" if _is_number(stats.get("cache_bytes")) else ""
            lines.append(f"attention cache: {stats['patch_frames']} frames{memory}")
        if self._corrections.loops:
            lines.append(f"loops: {len(self._corrections.accepted_loops)} accepted")
        self._readout.content = "  \n".join(lines)

    def _thumbnail(self, pred: FramePrediction) -> np.ndarray | None:
        if pred.image is None or self.thumbnail_px <= 0:
            return None
        return thumbnail(pred.image, self.thumbnail_px)

    def _frustum_scale(self) -> float:
        return 0.08 * (self._scene_scale or 1.0)

    def _point_size(self) -> float:
        # About the spacing of 20k points sampled from a 518 x 378 frame, at the median depth.
        return 0.006 * (self._scene_scale or 1.0) * self._point_size_factor

    # ------------------------------------------------------------------------------------------- GUI

    def _build_gui(self, inference_controls: bool) -> None:
        gui = self.server.gui
        self._pause_button = None
        with gui.add_folder("Run"):
            self._status = gui.add_markdown("**waiting for frames**")
            if inference_controls:
                self._status.content = "**running**"
                self._pause_button = gui.add_button("Pause inference")

                @self._pause_button.on_click
                def _(_event) -> None:
                    self.set_paused(not self.paused)
                    self._status.content = "**paused**" if self.paused else "**running**"

            self._readout = gui.add_markdown("frame -")
            self._frame_image = gui.add_image(np.zeros((24, 32, 3), np.uint8), label="current frame", visible=False)

        with gui.add_folder("Points"):
            confidence = gui.add_slider(
                "Min. confidence", min=1.0, max=max(MAX_CONFIDENCE_SLIDER, self._min_confidence), step=0.1,
                initial_value=self._min_confidence, hint="Points whose depth confidence is below this are hidden, as "
                "--conf-threshold leaves them out of points.ply (confidence is 1 + exp(logit): 1 keeps all)."
            )
            size = gui.add_slider("Point size x", min=0.1, max=5.0, step=0.1, initial_value=1.0)
            low = min(500, self.max_points_per_keyframe)
            budget = gui.add_slider(
                "Points / keyframe",
                min=low,
                max=self.max_points_per_keyframe,
                step=max(1, (self.max_points_per_keyframe - low) // 40),
                initial_value=self._points_per_keyframe,
            )

            @confidence.on_update
            def _(_event) -> None:
                self._min_confidence = float(confidence.value)
                self._request_rebuild()

            @size.on_update
            def _(_event) -> None:
                # A size change is a cheap property update on every cloud, not a re-send of points.
                self._point_size_factor = float(size.value)
                self._wake.set()

            @budget.on_update
            def _(_event) -> None:
                self._points_per_keyframe = int(budget.value)
                self._request_rebuild()

        with gui.add_folder("Keyframes"):
            show_all = gui.add_checkbox("Show all", initial_value=True)
            last_n = gui.add_slider(
                "Last N", min=1, max=max(2, self.max_keyframes), step=1, initial_value=self._last_n
            )

            @show_all.on_update
            def _(_event) -> None:
                self._show_all = bool(show_all.value)
                self._wake.set()

            @last_n.on_update
            def _(_event) -> None:
                self._last_n = int(last_n.value)
                self._wake.set()

        with gui.add_folder("Camera"):
            follow = gui.add_checkbox("Follow current camera", initial_value=False)
            reset = gui.add_button("Reset view")

            @follow.on_update
            def _(_event) -> None:
                self._follow = bool(follow.value)

            @reset.on_click
            def _(_event) -> None:
                self._reset_view()

    def _reset_view(self) -> None:
        """Look at the start of the reconstruction from behind and above the first camera."""
        scale = self._scene_scale or 1.0
        position = np.array([0.0, -0.8, -1.2]) * scale  # OpenCV world: -y is up, +z is forward
        look_at = np.array([0.0, 0.0, 1.0]) * scale
        self.server.initial_camera.position = position
        self.server.initial_camera.look_at = look_at
        self._move_clients(position, look_at, np.array([0.0, -1.0, 0.0]))

    def _move_clients_to(self, c2w: np.ndarray) -> None:
        """Put every browser's camera a little behind and above the current camera, looking along it."""
        scale = self._scene_scale or 1.0
        rotation, centre = c2w[:3, :3], c2w[:3, 3]
        forward, down = rotation[:, 2], rotation[:, 1]
        position = centre - 0.5 * scale * forward - 0.2 * scale * down
        self._move_clients(position, centre + scale * forward, -down)

    def _move_clients(self, position: np.ndarray, look_at: np.ndarray, up: np.ndarray) -> None:
        for client in self.server.get_clients().values():
            try:
                with client.atomic():
                    client.camera.position = position
                    client.camera.look_at = look_at
                    client.camera.up_direction = up
            except (AssertionError, ValueError):
                continue  # this browser has not reported its camera yet
