"""The keyframes of the scene graph: a node per chunk (`/chunks/C`), under it a posed node per keyframe with
its point cloud and frustum, the caps that bound them, and the corrections that move the chunk nodes.

A keyframe hangs under the node of the chunk that emitted it last, in the open chain's coordinates, so a
loop closure moves one node per chunk. viser's nodes carry no scale, so a chunk whose correction scales it
holds its keyframes' positions and points multiplied by that scale. Because points live in their camera's
frame, a pose correction (chunked streams re-emit frames aligned into chunk 0's frame) moves one parent
node and never re-sends points unless the depth itself changed.

Caps that keep the browser smooth over long runs: at most `max_points_per_keyframe` points per cloud, at
most `max_keyframes` keyframe nodes, at most `max_total_points` points in total. Over the total, the oldest
keyframes are first thinned to a quarter of their points, then removed (geometry.allocate_point_budget).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import viser

from stream_recon.app.viewer import geometry as geo
from stream_recon.app.viewer.control_panel import DisplaySettings
from stream_recon.models import FramePrediction
from stream_recon.models.loops.corrections import ChunkCorrections

KEYFRAME_COLOR = (90, 90, 90)


@dataclass
class _ChunkNode:
    """Server-side record of one chunk's node."""

    handle: Any  # viser.FrameHandle at the rotation and translation of the chunk's correction
    scale: float = 1.0  # its children's coordinates are this times the chain's (geometry.node_scale)


@dataclass
class _Keyframe:
    """Server-side record of one keyframe on screen."""

    frame_index: int
    chunk_index: int
    centre: np.ndarray  # [3] its camera centre in the open chain
    sample: geo.KeyframeSample
    fingerprint: int
    parent: Any  # viser.FrameHandle
    frustum: Any  # viser.CameraFrustumHandle
    cloud: Any = None  # viser.PointCloudHandle, or GaussianSplatHandle when the settings show splats
    shown_count: int = 0  # prefix of `sample` currently on screen (before the confidence filter)
    shown_points: int = 0  # points (or splats) on screen: that prefix after the filter
    shown_settings: tuple = ()  # what the cloud was built with (KeyframeMap._cloud_settings)


class KeyframeMap:
    """The chunk and keyframe nodes on screen and what they were built from; touched by the viewer thread.
    `on_scale_known` runs once, when the first keyframe sets the scene's scale."""

    def __init__(self, server: viser.ViserServer, settings: DisplaySettings, on_scale_known: Callable[[], None],
                 *, max_points_per_keyframe: int, max_total_points: int, max_keyframes: int,
                 max_new_clouds_per_second: float | None, thumbnail_px: int, masker: Any = None) -> None:
        self.server = server
        self.masker = masker  # an app.outputs.masks.FrameMasker whose dropped pixels the clouds leave out, or None
        self.settings = settings
        self._on_scale_known = on_scale_known
        self.max_points_per_keyframe = max_points_per_keyframe
        self.max_total_points = max_total_points
        self.max_keyframes = max_keyframes
        self.max_new_clouds_per_second = max_new_clouds_per_second
        # The bucket holds a second's clouds, and at least one: at a rate under one a second it would never fill.
        self._cloud_bucket = max(1.0, max_new_clouds_per_second or 0.0)
        self._cloud_tokens = self._cloud_bucket
        self._tokens_at = time.perf_counter()
        self.thumbnail_px = thumbnail_px
        self.shown: dict[int, _Keyframe] = {}  # frame index -> the keyframe on screen
        self.chunks: dict[int, _ChunkNode] = {}
        self.corrections = ChunkCorrections(by_chunk={}, version=-1)  # the last applied; -1: none yet
        self._evicted_up_to = -1  # keyframes at or below this index were dropped by the caps
        self._waiting: FramePrediction | None = None  # the newest keyframe, left without a cloud for want of a token
        self.scene_scale: float | None = None  # the first keyframe's median depth

    def add_predictions(self, predictions: dict[int, FramePrediction]) -> None:
        """Show, move or drop the keyframe of each prediction, in frame order."""
        drawn = self._new_clouds_allowed(predictions)
        for index in sorted(predictions):
            self.apply_prediction(predictions[index], draw_cloud=index in drawn)
        self._note_newest(predictions)

    def _note_newest(self, predictions: dict[int, FramePrediction]) -> None:
        """Keep the newest keyframe the token bucket left without a cloud: `draw_waiting` draws it once a token
        comes, unless a newer keyframe is drawn first."""
        waiting = self._waiting
        if waiting is not None and not predictions.get(waiting.frame_index, waiting).is_keyframe:
            self._waiting = waiting = None  # re-emitted as a non-keyframe
        keyframes = [index for index, pred in predictions.items() if pred.is_keyframe]
        if self.max_new_clouds_per_second is None or not keyframes:
            return
        newest = max(keyframes)
        if waiting is None or newest >= waiting.frame_index:
            self._waiting = None if newest in self.shown else predictions[newest]

    def draw_waiting(self, now_anyway: bool = False) -> float | None:
        """The newest keyframe left without a cloud, drawn once the bucket holds a token, or at once where
        `now_anyway` (the viewer's last update). Returns the seconds until a token comes while it waits, else None."""
        waiting = self._waiting
        if waiting is None:
            return None
        index = waiting.frame_index
        if index in self.shown or index <= self._evicted_up_to or any(shown > index for shown in self.shown):
            self._waiting = None
            return None
        tokens = self._refilled_tokens()
        if tokens < 1.0 and not now_anyway:
            return (1.0 - tokens) / self.max_new_clouds_per_second
        self._add(waiting)
        self._cloud_tokens -= 1.0
        self._waiting = None
        return None

    def truncate(self, frame_index: int) -> None:
        for index in [i for i in self.shown if i > frame_index]:
            self._remove(index)
        if self._waiting is not None and self._waiting.frame_index > frame_index:
            self._waiting = None
        # Keyframes dropped by the caps may fit again once the newer ones are gone.
        self._evicted_up_to = -1

    def _new_clouds_allowed(self, predictions: dict[int, FramePrediction]) -> set[int]:
        """Which of these new keyframes get a cloud: all while the token bucket holds enough, else as
        many as it holds, spread evenly over them and always the newest."""
        if self.max_new_clouds_per_second is None:
            return set(predictions)
        allowed = int(self._refilled_tokens())
        new = [i for i in sorted(predictions) if predictions[i].is_keyframe and i not in self.shown
               and i > self._evicted_up_to]
        if len(new) > allowed:
            new = [new[round(k)] for k in np.linspace(len(new) - 1, 0, allowed)] if allowed else []
        self._cloud_tokens -= len(new)
        return set(new)

    def _refilled_tokens(self) -> float:
        rate = self.max_new_clouds_per_second
        now = time.perf_counter()
        self._cloud_tokens = min(self._cloud_bucket, self._cloud_tokens + (now - self._tokens_at) * rate)
        self._tokens_at = now
        return self._cloud_tokens

    def apply_prediction(self, pred: FramePrediction, draw_cloud: bool = True) -> None:
        index = pred.frame_index
        existing = self.shown.get(index)
        if not pred.is_keyframe:
            if existing is not None:  # re-emitted as a non-keyframe: it no longer belongs in the map
                self._remove(index)
            return
        if existing is None:
            if index > self._evicted_up_to and draw_cloud:
                self._add(pred)
            return
        fingerprint = geo.depth_fingerprint(pred)
        if fingerprint != existing.fingerprint or pred.chunk_index != existing.chunk_index:
            self._remove(index)  # new depth, or the node of the chunk that emitted it now
            self._add(pred, fingerprint)
            return
        wxyz, position = geo.node_pose(pred.c2w)
        existing.centre = position.astype(np.float32)
        existing.parent.wxyz = wxyz
        existing.parent.position = self.chunks[existing.chunk_index].scale * position

    def _add(self, pred: FramePrediction, fingerprint: int | None = None) -> None:
        # the masks of the keyframes it draws only, on the viewer thread
        dropped = None if self.masker is None else self.masker.dropped(pred.frame_index, pred.image, pred.image_size)
        sample = geo.sample_keyframe_points(pred, self.max_points_per_keyframe, dropped)
        if self.scene_scale is None and sample.num_points:
            self.scene_scale = float(np.median(sample.points[:, 2].astype(np.float32)))
            self._on_scale_known()
        wxyz, position = geo.node_pose(pred.c2w)
        chunk = self._chunk_node(pred.chunk_index)
        name = f"/chunks/{pred.chunk_index}/f{pred.frame_index:06d}"
        parent = self.server.scene.add_frame(name, show_axes=False, wxyz=wxyz, position=chunk.scale * position)
        frustum = self.add_frustum(f"{name}/frustum", pred, 1.0, 1.5, KEYFRAME_COLOR)
        if fingerprint is None:
            fingerprint = geo.depth_fingerprint(pred)
        self.shown[pred.frame_index] = _Keyframe(pred.frame_index, pred.chunk_index, position.astype(np.float32),
                                                 sample, fingerprint, parent, frustum)

    def add_frustum(self, name: str, pred: FramePrediction, size: float, thickness: float, color: tuple,
                    **pose: np.ndarray) -> Any:
        """A frustum of the model input's field of view, `size` times the scene's frustum scale, with a
        thumbnail of the frame (a keyframe's, or the current camera's)."""
        fov_y, aspect = geo.field_of_view(pred)
        return self.server.scene.add_camera_frustum(
            name, fov=fov_y, aspect=aspect, scale=size * self._frustum_scale(), thickness=thickness,
            thickness_units="screen", color=color, image=self.thumbnail(pred), format="jpeg", jpeg_quality=70,
            **pose,
        )

    def _remove(self, index: int) -> None:
        keyframe = self.shown.pop(index)
        keyframe.parent.remove()  # takes the cloud and the frustum with it

    def thumbnail(self, pred: FramePrediction) -> np.ndarray | None:
        if pred.image is None or self.thumbnail_px <= 0:
            return None
        return geo.thumbnail(pred.image, self.thumbnail_px)

    def _frustum_scale(self) -> float:
        return 0.08 * (self.scene_scale or 1.0)

    def _point_size(self) -> float:
        # About the spacing of 20k points sampled from a 518 x 378 frame, at the median depth.
        return 0.006 * (self.scene_scale or 1.0) * self.settings.point_size_factor

    # -------------------------------------------------------------------------- caps and point clouds

    def enforce_caps(self, rebuild_all: bool) -> None:
        order = sorted(self.shown)  # oldest first: frame order, not arrival order
        for index in order[: max(0, len(order) - self.max_keyframes)]:
            self._evicted_up_to = max(self._evicted_up_to, index)
            self._remove(index)
        order = sorted(self.shown)
        budget = self.settings.points_per_keyframe
        full = [min(budget, self.shown[i].sample.num_points) for i in order]
        counts = geo.allocate_point_budget(full, self.max_total_points)
        for index, count in zip(order, counts, strict=True):
            keyframe = self.shown[index]
            if count == 0:
                self._evicted_up_to = max(self._evicted_up_to, index)
                self._remove(index)
            elif rebuild_all or count != keyframe.shown_count or self._cloud_settings(keyframe) != keyframe.shown_settings:
                self._show_cloud(keyframe, count)
            elif keyframe.cloud is not None and self.settings.show == "points":
                keyframe.cloud.point_size = self._point_size()

    def _cloud_settings(self, keyframe: _Keyframe) -> tuple:
        """What a keyframe's cloud is built from besides its sample: a change re-sends it."""
        s = self.settings  # a splat's width is in its covariance: a size change re-sends splats, never points
        size = s.point_size_factor if s.show == "splats" else None
        return s.min_confidence, s.points_per_keyframe, self.chunks[keyframe.chunk_index].scale, s.show, size

    def _show_cloud(self, keyframe: _Keyframe, count: int) -> None:
        scale = self.chunks[keyframe.chunk_index].scale
        # Same-name re-add replaces the node (and its buffered create message) in one step; assigning
        # points and colours separately would briefly pair arrays of different lengths on the client.
        # Points and splats share the name, so switching between them replaces one with the other.
        settings, name = self.settings, f"{keyframe.parent.name}/points"
        if settings.show == "splats":
            centres, covariances, colors, opacities = geo.splat_arrays(
                keyframe.sample, count, settings.min_confidence, scale, settings.point_size_factor)
            keyframe.cloud = self.server.scene.add_gaussian_splats(
                name, centers=centres, covariances=covariances, rgbs=colors, opacities=opacities)
        else:
            centres, colors = geo.cloud_arrays(keyframe.sample, count, settings.min_confidence, scale)
            keyframe.cloud = self.server.scene.add_point_cloud(
                name, points=centres, colors=colors, point_size=self._point_size(), point_shape="square",
                precision="float16", point_shading="flat")
        keyframe.shown_points = len(centres)
        keyframe.shown_count = count
        keyframe.shown_settings = self._cloud_settings(keyframe)

    def apply_visibility(self) -> None:
        newest_first = sorted(self.shown, reverse=True)
        for rank, index in enumerate(newest_first):
            self.shown[index].parent.visible = self.settings.show_all or rank < self.settings.last_n

    # ------------------------------------------------------------------ corrections and the chunk nodes

    def apply_corrections(self, corrections: ChunkCorrections) -> None:
        """Move every chunk node by its correction; nothing for one not newer than the last applied."""
        if corrections.version <= self.corrections.version:
            return
        self.corrections = corrections
        for chunk_index, node in self.chunks.items():
            self._place_chunk(chunk_index, node)

    def _place_chunk(self, chunk_index: int, node: _ChunkNode) -> None:
        """Pose the chunk's node by its correction; a new scale moves its keyframes' parents here and
        re-sends their clouds in `enforce_caps` (their settings no longer match)."""
        transform = self.corrections.for_chunk(chunk_index)
        node.handle.wxyz, node.handle.position = geo.node_pose(transform.matrix)  # its rotation and translation
        scale = geo.node_scale(transform)
        if scale == node.scale:
            return
        node.scale = scale
        for keyframe in self.shown.values():
            if keyframe.chunk_index == chunk_index:
                keyframe.parent.position = scale * keyframe.centre.astype(np.float64)

    def _chunk_node(self, chunk_index: int) -> _ChunkNode:
        node = self.chunks.get(chunk_index)
        if node is None:
            node = _ChunkNode(self.server.scene.add_frame(f"/chunks/{chunk_index}", show_axes=False))
            self.chunks[chunk_index] = node
            if not self.corrections.is_identity:
                self._place_chunk(chunk_index, node)
        return node
