"""The scene graph of the live viewer: what is drawn in viser's scene, one update at a time.

Scene tree (world = the model's frame, OpenCV axes, so the scene's up direction is -y):

    /chunks/2                    chunk 2's node: the rotation and translation of its loop-closure correction
    /chunks/2/f000123            posed parent: position + wxyz of keyframe 123's c2w (T_world_camera)
    /chunks/2/f000123/points     its point cloud in its own camera frame, float16, coloured by the frame
    /chunks/2/f000123/frustum    its frustum with a thumbnail of the frame
    /trajectory                  every camera centre seen so far, in frame order, as one line-segment node
    /current                     the newest camera, highlighted
    /loops                       one segment per accepted loop, between its two cameras

The chunk and keyframe nodes, their caps and the corrections that move them are keyframes.py's. The
trajectory, the current camera and the loop segments live in the corrected world itself: this module
moves each of their points by its chunk's correction. Nodes are updated through their handles instead of
being re-added, so viser's message buffer coalesces repeated updates of a node and keeps the current scene
for browsers that join late.

Cost, measured on a 2-core CPU shared with other jobs (load average 8-11), frames at the model's input
size (378 x 518), every frame a keyframe, default caps: the viewer thread spends about 15 ms per keyframe
(half in viser creating scene nodes, a quarter in sampling points), i.e. about half of one core at 30
keyframes per second; `scene_summary()["busy_seconds"]` reports it for any run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import viser

from stream_recon.app.viewer import geometry as geo
from stream_recon.app.viewer.control_panel import DisplaySettings
from stream_recon.app.viewer.keyframes import KeyframeMap
from stream_recon.models import FramePrediction
from stream_recon.models.loops.corrections import ChunkCorrections

if TYPE_CHECKING:
    from stream_recon.app.viewer.live_state import Pending

CURRENT_COLOR = (255, 120, 0)
TRAJECTORY_COLOR = (255, 60, 60)
LOOP_COLOR = (0, 170, 255)


class SceneGraph:
    """The viewer's scene: its keyframe map (keyframes.py) and the nodes of the corrected world. Touched
    only by the viewer thread, but for `reset_view` (a GUI callback's, which reads the scene's scale alone)
    and the read-only summaries."""

    def __init__(self, server: viser.ViserServer, settings: DisplaySettings, **caps) -> None:
        """`caps`: KeyframeMap's (max_points_per_keyframe, max_total_points, max_keyframes,
        max_new_clouds_per_second, thumbnail_px, masker)."""
        self.server = server
        self.settings = settings
        self.keyframes = KeyframeMap(server, settings, self.reset_view, **caps)
        self.centres: dict[int, geo.ChainCentre] = {}  # every frame seen, keyframe or not
        self._loop_edges = None
        self._loop_segments = np.zeros((0, 2, 3), np.float32)
        self._trajectory = None
        self._current = None
        self.current_index = -1
        self._current_chunk = 0
        self._current_chain_c2w: np.ndarray | None = None  # as emitted, in the open chain
        self._current_c2w: np.ndarray | None = None  # corrected

    @property
    def corrections(self) -> ChunkCorrections:
        """The last correction applied to the scene."""
        return self.keyframes.corrections

    @property
    def scene_scale(self) -> float | None:
        """The first keyframe's median depth: the scale of frustums, point sizes and camera moves."""
        return self.keyframes.scene_scale

    def apply(self, pending: Pending) -> float | None:
        """One update of the viewer thread: what was handed over since the last, in one atomic change. Returns
        the seconds after which it would draw a keyframe still waiting for a token though nothing new comes."""
        with self.server.atomic():
            if pending.truncate_after is not None:
                self._truncate(pending.truncate_after)
            self.centres.update(pending.poses)
            if pending.corrections is not None:
                self.keyframes.apply_corrections(pending.corrections)
            self.centres.update({index: geo.ChainCentre.of(pred.c2w, pred.chunk_index)
                                 for index, pred in pending.predictions.items()})
            self.keyframes.add_predictions(pending.predictions)
            due = self.keyframes.draw_waiting(now_anyway=pending.last)
            self.keyframes.enforce_caps(rebuild_all=pending.rebuild_clouds)
            self.keyframes.apply_visibility()
            self._update_trajectory()
            self._update_loop_edges()
        if pending.predictions:
            self._update_current(pending.predictions[max(pending.predictions)])
        elif pending.corrections is not None:
            self._place_current()
        return due

    def summary(self) -> dict:
        """What is on screen: keyframes, scene nodes this viewer owns, points, trajectory length."""
        keyframes = list(self.keyframes.shown.values())  # a copy: the viewer thread may be adding to it
        own_nodes = 3 * len(keyframes) + len(self.keyframes.chunks)
        own_nodes += sum(node is not None for node in (self._trajectory, self._current, self._loop_edges))
        return {
            "keyframes": len(keyframes),
            "nodes": own_nodes,
            "points": sum(kf.shown_points for kf in keyframes if kf.cloud is not None),
            "trajectory_frames": len(self.centres),
            "current_frame": self.current_index,
        }

    def _truncate(self, frame_index: int) -> None:
        self.keyframes.truncate(frame_index)
        for index in [i for i in self.centres if i > frame_index]:
            del self.centres[index]
        if self.current_index > frame_index:
            self.current_index = -1

    def _update_trajectory(self) -> None:
        if len(self.centres) < 2:
            return
        centres = geo.corrected_centres(self.centres, sorted(self.centres), self.corrections)  # [S, 3]
        segments = np.stack([centres[:-1], centres[1:]], axis=1)  # [S - 1, 2, 3]
        if self._trajectory is None:
            self._trajectory = self.server.scene.add_line_segments(
                "/trajectory", segments, colors=TRAJECTORY_COLOR, thickness=2.0, thickness_units="screen"
            )
        else:
            self._trajectory.points = segments

    def _update_loop_edges(self) -> None:
        """The accepted loops' segments (geometry.loop_segments); re-sent only when they change."""
        segments = geo.loop_segments(self.centres, self.corrections)
        if np.array_equal(segments, self._loop_segments):
            return
        self._loop_segments = segments
        if len(segments):  # a same-name re-add replaces the node, its colours sized to the new segments
            self._loop_edges = self.server.scene.add_line_segments(
                "/loops", segments, colors=LOOP_COLOR, thickness=3.0, thickness_units="screen"
            )
        elif self._loop_edges is not None:
            self._loop_edges.remove()
            self._loop_edges = None

    # ------------------------------------------------------------- the current camera, the browsers'

    def _place_current(self) -> None:
        """Put the current camera where the last applied correction moves it."""
        if self._current is None or self._current_chain_c2w is None:
            return
        self._current_c2w = self.corrections.corrected_c2w(self._current_chunk, self._current_chain_c2w)
        self._current.wxyz, self._current.position = geo.node_pose(self._current_c2w)
        self._follow_current()

    def _update_current(self, pred: FramePrediction) -> None:
        if pred.frame_index < self.current_index:
            return
        self.current_index = pred.frame_index
        self._current_chunk = pred.chunk_index
        self._current_chain_c2w = np.asarray(pred.c2w, dtype=np.float64)
        self._current_c2w = self.corrections.corrected_c2w(pred.chunk_index, self._current_chain_c2w)
        wxyz, position = geo.node_pose(self._current_c2w)
        with self.server.atomic():
            if self._current is None:
                self._current = self.keyframes.add_frustum("/current", pred, 1.6, 4.0, CURRENT_COLOR,
                                                           wxyz=wxyz, position=position)
            else:
                self._current.wxyz = wxyz
                self._current.position = position
                thumb = self.keyframes.thumbnail(pred)
                if thumb is not None:
                    self._current.image = thumb
        self._follow_current()

    def _follow_current(self) -> None:
        """While "Follow current camera" is on: every browser's camera behind the current one."""
        if self.settings.follow:
            self._move_clients(geo.ViewPose.following(self._current_c2w, self.scene_scale or 1.0))

    def reset_view(self) -> None:
        """Look at the start of the reconstruction from behind and above the first camera."""
        view = geo.ViewPose.start(self.scene_scale or 1.0)
        self.server.initial_camera.position = view.position
        self.server.initial_camera.look_at = view.look_at
        self._move_clients(view)

    def _move_clients(self, view: geo.ViewPose) -> None:
        for client in self.server.get_clients().values():
            try:
                with client.atomic():
                    client.camera.position = view.position
                    client.camera.look_at = view.look_at
                    client.camera.up_direction = view.up
            except (AssertionError, ValueError):
                continue  # this browser has not reported its camera yet
