"""Live browser viewer (viser): watch the reconstruction grow while the stream runs.

`LiveViewer` is the one object the rest of the app holds (the run loop's sink, loop closure's corrections,
a replay's timeline). It wires three pieces, in the shape of nerfstudio's viewer:

    live_state.py     the latest-wins hand-off from the run loop to the viewer thread, the pause, and the
                      viewer thread under supervision (VIEWER_STALL_S, VIEWER_CLOSE_S, VIEWER_STOP_S)
    scene.py          the scene graph: what is drawn in viser's scene, one update at a time
      keyframes.py    its chunk and keyframe nodes, their point clouds, the caps and the corrections
    control_panel.py  the GUI folders, their readouts and callbacks (and a replay's timeline)
    geometry.py       pure helpers: point sampling and budgets, poses, corrected centres, view poses
    replay.py         a run directory played back on it (`stream-recon view`)

Cost, measured on a 2-core CPU shared with other jobs (load average 8-11), frames at the model's input
size (378 x 518), every frame a keyframe, default caps: 1000 `on_frame` calls take about 4 ms in all,
with no browser or with one that never reads; scene.py's docstring gives the viewer thread's cost.

The names re-exported here are read where they are defined, when a viewer is made: a test passes its own
limits (`LiveViewer(policy=..., close_s=...)`); one that changes VIEWER_CLOSE_S, say, sets live_state's.

May import: outputs (the run directory a replay reads, splats), the shared modules at app/'s top (options,
stopping) and stream_recon.models.
Imports nothing of: sources, run, evaluation, commands.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import viser

from stream_recon.app.options import VIEWER_HOST, VIEWER_PORT
from stream_recon.app.viewer.control_panel import ControlPanel, DisplaySettings
from stream_recon.app.viewer.geometry import KeyframeSample, allocate_point_budget, sample_keyframe_points
from stream_recon.app.viewer.live_state import (
    VIEWER_CLOSE_S,
    VIEWER_POLICY,
    VIEWER_STALL_S,
    VIEWER_STOP_S,
    LiveState,
    Pending,
    stop_server,
    web_server_threads,
)
from stream_recon.app.viewer.scene import SceneGraph
from stream_recon.models import FramePrediction
from stream_recon.models.loops.corrections import ChunkCorrections
from stream_recon.models.supervision import Helper, HelperPolicy

__all__ = [
    "VIEWER_CLOSE_S", "VIEWER_POLICY", "VIEWER_STALL_S", "VIEWER_STOP_S", "KeyframeSample", "LiveViewer",
    "allocate_point_budget", "sample_keyframe_points",
]


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
        show: str = "points",  # points | splats (app.options.SHOW_CHOICES); the browser's panel can change it
        masker: Any = None,  # app.outputs.masks.FrameMasker: pixels the live clouds leave out (a replay's npz carry them)
        policy: HelperPolicy | None = None,  # the viewer thread's: its stall limit (None: VIEWER_POLICY)
        close_s: float | None = None,  # how long closing waits for its last update (None: VIEWER_CLOSE_S)
    ) -> None:
        if max_points_per_keyframe < 1 or max_total_points < max_points_per_keyframe:
            raise ValueError(
                f"viewer caps are inconsistent: max_points_per_keyframe={max_points_per_keyframe} must be "
                f">= 1 and <= max_total_points={max_total_points}"
            )
        self.max_keyframes = max_keyframes
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

        self.settings = DisplaySettings(
            points_per_keyframe=min(points_per_keyframe or max_points_per_keyframe, max_points_per_keyframe),
            min_confidence=float(min_confidence), last_n=min(50, max_keyframes), show=show,
        )
        # New keyframe clouds the scene takes per second, on average (bursts up to one second's worth;
        # None: every keyframe). A live run sets it: with every frame a keyframe at 40 FPS, a cloud per
        # keyframe keeps the viewer thread busy ~29 ms per frame with a browser connected
        # (scripts/bench_e2e.py measures it), Python work that competes with the stream's for the
        # interpreter. Frames 25 ms apart show nearly the same points; the skipped ones still extend
        # the trajectory, and points.ply keeps every frame. The newest keyframe a burst left without a cloud
        # gets one when the next token comes, unless a newer one is drawn first.
        self.state = LiveState(self._draw, update_hz=update_hz, max_pending=max_pending, policy=policy,
                               close_s=close_s, library_threads=lambda: web_server_threads(self.server))
        self.scene = SceneGraph(
            self.server, self.settings, max_points_per_keyframe=max_points_per_keyframe,
            max_total_points=max_total_points, max_keyframes=max_keyframes,
            max_new_clouds_per_second=max_new_clouds_per_second, thumbnail_px=thumbnail_px, masker=masker,
        )
        self.panel = ControlPanel(
            self.server.gui, self.settings, max_points_per_keyframe=max_points_per_keyframe,
            max_keyframes=max_keyframes, inference_controls=inference_controls, toggle_pause=self._toggle_pause,
            on_rebuild=self._request_rebuild, on_redraw=self._redraw, on_reset_view=self.scene.reset_view,
        )
        self.state.start()  # last: the viewer thread draws into the scene and the panel

    # ----------------------------------------------------------------------------------------- sink API

    def on_frame(self, pred: FramePrediction, stats: dict) -> None:
        """Queue one prediction for display; O(1), never waits for the browser or the viewer thread. Nothing
        once the viewer is off (its thread raised, or an update ran past VIEWER_STALL_S)."""
        self.state.on_frame(pred, stats)

    @property
    def is_up(self) -> bool:
        """Whether the viewer still draws: not off after its thread raised or an update stalled."""
        return self.state.is_up

    @property
    def helper(self) -> Helper:
        """The viewer thread's supervision (models/supervision.py)."""
        return self.state.helper

    def helpers(self) -> dict[str, Helper]:
        """The viewer thread's helper, by run.json's name (models/supervision.py's HelperOwner)."""
        return {"viewer": self.helper}

    def close(self, status: str = "complete") -> None:
        """Show the last state (VIEWER_CLOSE_S at most), stop the viewer thread and, unless `keep_serving`,
        the server."""
        if self.state.closed:
            return
        self.state.close()
        try:
            self.panel.show_closed(status)
        except RuntimeError:
            pass
        if not self.keep_serving:
            self.stop()

    def set_status(self, text: str) -> None:
        """The status line at the top of the GUI panel (markdown)."""
        self.panel.set_status(text)

    def stop(self) -> None:
        """Stop the web server (after `close`, when the viewer was kept serving); VIEWER_STOP_S at most."""
        stop_server(self.server, self.helper)

    def __enter__(self) -> LiveViewer:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("complete" if exc_type is None else "failed")

    # ---------------------------------------------------------------------------- run-loop controls

    @property
    def paused(self) -> bool:
        return self.state.paused

    def set_paused(self, paused: bool) -> None:
        self.state.set_paused(paused)
        self.panel.show_paused(paused)

    def wait_if_paused(self, timeout: float | None = None) -> bool:
        """Block the calling (inference) thread while the browser has paused the run (never once the
        viewer is off).

        Returns False when `timeout` ran out while still paused."""
        return self.state.wait_if_paused(timeout)

    # ------------------------------------------------------------------------------- replay controls

    def push_poses(self, c2w_by_frame: dict[int, np.ndarray], chunk_index: int = 0) -> None:
        """Queue camera poses only (no points), e.g. a replay's trajectory up to the timeline position;
        a correction moves them as chunk `chunk_index`'s emissions."""
        self.state.push_poses(c2w_by_frame, chunk_index)

    def show_earlier_map(self, xyz: np.ndarray, rgb: np.ndarray) -> None:
        """The cloud of the map the stream extends (`run --map`: the earlier run's points.ply), drawn once and
        never moved: the stream's own points come into its frame once the stream is placed in it."""
        self.server.scene.add_point_cloud("/earlier_map", points=xyz, colors=rgb, point_size=self._earlier_point_size(xyz),
                                          point_shape="square", precision="float16", point_shading="flat")

    def _earlier_point_size(self, xyz: np.ndarray) -> float:
        # a thousandth of the cloud's extent: visible from afar without hiding the live points
        return float(max(np.ptp(xyz, axis=0).max(), 1e-6) * 1e-3) if len(xyz) else 1e-3

    def apply_corrections(self, corrections: ChunkCorrections) -> None:
        """Queue a solved pose graph: each chunk's node moves by its correction, and the accepted loops
        are drawn. One whose version is not newer than the last applied or queued one is ignored."""
        self.state.queue_corrections(corrections)

    def truncate_after(self, frame_index: int) -> None:
        """Forget every frame after `frame_index` (a replay's timeline moved back); queued like a frame."""
        self.state.truncate_after(frame_index)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued so far is on the scene (tests, replay seeks)."""
        return self.state.flush(timeout)

    def shown_keyframes(self) -> set[int]:
        """Frame indices of the keyframes on screen (as of the last viewer update)."""
        return set(list(self.scene.keyframes.shown))

    @property
    def num_pending(self) -> int:
        """Frames queued and not yet drawn: at most `max_pending` predictions, plus the poses of any
        frames that overflowed (a few floats each)."""
        return self.state.num_pending

    def scene_summary(self) -> dict:
        """What is on screen (keyframes, scene nodes this viewer owns, points, trajectory length) and the
        viewer thread's cost (updates drawn, seconds spent drawing them)."""
        return {**self.scene.summary(), "updates": self.state.num_updates,
                "busy_seconds": round(self.state.busy_seconds, 3)}

    # ------------------------------------------------------------------------------------- internals

    def _toggle_pause(self) -> bool:
        """The pause button's: flip the pause; whether the run is paused now."""
        self.set_paused(not self.paused)
        return self.paused

    def _request_rebuild(self) -> None:
        self.state.request_rebuild()

    def _redraw(self) -> None:
        self.state.wake()

    def _draw(self, pending: Pending, arrival_fps: float) -> float | None:
        """One update of the viewer thread: the scene, then the panel's current frame and readout. Returns when
        to draw again though nothing new comes (scene.apply)."""
        due = self.scene.apply(pending)
        if pending.predictions:
            self.panel.show_frame(pending.predictions[max(pending.predictions)].image)
        self.panel.show_readout(
            pending.stats, arrival_fps, frame_index=self.scene.current_index,
            num_keyframes=len(self.scene.keyframes.shown), num_points=self.scene.summary()["points"],
            corrections=self.scene.corrections,
        )
        return due
