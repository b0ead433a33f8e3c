"""The control panel: the GUI folders of the live viewer (Run, Points, Keyframes, Camera) and of a replay,
their readouts, and their callbacks. GUI wiring as in viser's examples/00_getting_started/01_core_concepts.py
(`with gui.add_folder(...)`, `@handle.on_update`); like nerfstudio's control_panel.py, the panel holds the
controls and calls back into the viewer for what they do.

Callbacks run on viser's thread pool and never draw: a display setting goes into `DisplaySettings`, which
the viewer thread reads at its next update, requested through `on_rebuild` (re-send every cloud) or
`on_redraw` (a cheap pass over the scene's nodes).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import viser

from stream_recon.app.options import SHOW_CHOICES
from stream_recon.app.viewer.geometry import thumbnail
from stream_recon.models.loops.corrections import ChunkCorrections

MAX_CONFIDENCE_SLIDER = 10.0  # confidences above this are rare: a point that confident is kept anyway


@dataclass
class DisplaySettings:
    """What the browser chooses for the scene: written by the panel's callbacks, read by the viewer thread."""

    points_per_keyframe: int
    min_confidence: float  # as --conf-threshold: confidence is 1 + exp(logit), so 1 keeps every point
    last_n: int
    point_size_factor: float = 1.0
    show_all: bool = True
    follow: bool = False
    show: str = "points"  # points | splats (app.options.SHOW_CHOICES)


class ControlPanel:
    """The live viewer's GUI. With `inference_controls`, a button that pauses the run; `toggle_pause` flips
    the pause and returns whether the run is now paused."""

    def __init__(self, gui: viser.GuiApi, settings: DisplaySettings, *, max_points_per_keyframe: int,
                 max_keyframes: int, inference_controls: bool, toggle_pause: Callable[[], bool],
                 on_rebuild: Callable[[], None], on_redraw: Callable[[], None],
                 on_reset_view: Callable[[], None]) -> None:
        self.gui = gui
        self.settings = settings
        self._pause_button = None
        with gui.add_folder("Run"):
            self._status = gui.add_markdown("**waiting for frames**")
            if inference_controls:
                self._status.content = "**running**"
                self._pause_button = gui.add_button("Pause inference")

                @self._pause_button.on_click
                def _(_event) -> None:
                    self._status.content = "**paused**" if toggle_pause() else "**running**"

            self._readout = gui.add_markdown("frame -")
            self._frame_image = gui.add_image(np.zeros((24, 32, 3), np.uint8), label="current frame", visible=False)

        with gui.add_folder("Points"):
            confidence = gui.add_slider(
                "Min. confidence", min=1.0, max=max(MAX_CONFIDENCE_SLIDER, settings.min_confidence), step=0.1,
                initial_value=settings.min_confidence, hint="Points whose depth confidence is below this are hidden, "
                "as --conf-threshold leaves them out of points.ply (confidence is 1 + exp(logit): 1 keeps all)."
            )
            size = gui.add_slider("Point size x", min=0.1, max=5.0, step=0.1, initial_value=1.0)
            low = min(500, max_points_per_keyframe)
            budget = gui.add_slider(
                "Points / keyframe", min=low, max=max_points_per_keyframe,
                step=max(1, (max_points_per_keyframe - low) // 40), initial_value=settings.points_per_keyframe,
            )
            self._on_change(confidence, "min_confidence", float, on_rebuild)
            # A size change is a cheap property update on every cloud, not a re-send of points.
            self._on_change(size, "point_size_factor", float, on_redraw)
            self._on_change(budget, "points_per_keyframe", int, on_rebuild)
            show = gui.add_dropdown("Show as", SHOW_CHOICES, initial_value=settings.show,
                                    hint="points, or splats: a Gaussian per point, its opacity from the confidence")
            self._on_change(show, "show", str, on_rebuild)

        with gui.add_folder("Keyframes"):
            show_all = gui.add_checkbox("Show all", initial_value=True)
            last_n = gui.add_slider("Last N", min=1, max=max(2, max_keyframes), step=1, initial_value=settings.last_n)
            self._on_change(show_all, "show_all", bool, on_redraw)
            self._on_change(last_n, "last_n", int, on_redraw)

        with gui.add_folder("Camera"):
            follow = gui.add_checkbox("Follow current camera", initial_value=False)
            reset = gui.add_button("Reset view")
            self._on_change(follow, "follow", bool, None)  # read at the next update that moves the camera
            reset.on_click(lambda _event: on_reset_view())

    def _on_change(self, control: Any, setting: str, convert: type, then: Callable[[], None] | None) -> None:
        """On every change of `control`, its value (as `convert`) becomes `settings.<setting>`; then `then`."""

        @control.on_update
        def _(_event) -> None:
            setattr(self.settings, setting, convert(control.value))
            if then is not None:
                then()

    # ------------------------------------------------------------------------------ what it shows

    def set_status(self, text: str) -> None:
        """The status line at the top of the panel (markdown)."""
        self._status.content = text

    def show_paused(self, paused: bool) -> None:
        if self._pause_button is not None:
            self._pause_button.label = "Resume inference" if paused else "Pause inference"

    def show_closed(self, status: str) -> None:
        """The run's end: its status, and a pause button that does nothing any more."""
        self._status.content = f"**run {status}**"
        if self._pause_button is not None:
            self._pause_button.disabled = True

    def show_frame(self, image: np.ndarray | None) -> None:
        """The current frame [H, W, 3] uint8, small; a frame saved without its image (--no-save-images)
        shows none, rather than a stale or black one."""
        if image is not None:
            self._frame_image.image = thumbnail(image, 320)
        self._frame_image.visible = image is not None

    def show_readout(self, stats: dict, arrival_fps: float, *, frame_index: int, num_keyframes: int,
                     num_points: int, corrections: ChunkCorrections) -> None:
        """The frame on screen, and for a live run its rates and cache, from the run loop's stats (any key
        may be missing or None). A replay passes no stats: it has no frame rate of its own to show."""
        line = f"frame **{frame_index}**"
        if "fps" in stats:  # a live run: the run loop's rate, or the frames' arrival rate until it has one
            fps = stats["fps"] if _is_number(stats["fps"]) else arrival_fps
            line += f", FPS **{_format_number(fps)}**"
            if _is_number(stats.get("model_fps")):
                line += f" (model {_format_number(stats['model_fps'])})"
        lines = [line, f"keyframes on screen {num_keyframes}, points {num_points:,}"]
        if _is_number(stats.get("patch_frames")):  # the frames attention reads in full: scale + window
            memory = f", {stats['cache_bytes'] / 2**20:.1f} MiB" if _is_number(stats.get("cache_bytes")) else ""
            lines.append(f"attention cache: {stats['patch_frames']} frames{memory}")
        if corrections.loops:
            lines.append(f"loops: {len(corrections.accepted_loops)} accepted")
        self._readout.content = "  \n".join(lines)

    # ------------------------------------------------------------------------------------- replay

    def add_replay_folder(self, first: int, last: int, playback_fps: float, *, on_seek: Callable[[int], None],
                          on_play: Callable[[], None], on_speed: Callable[[float], None]) -> ReplayControls:
        """A replay's timeline over frame indices first..last, its play button and its speed, above the rest.
        `on_seek` gets the frame index a browser moved the timeline to."""
        with self.gui.add_folder("Replay", order=-1):
            timeline = self.gui.add_slider("Frame", min=first, max=max(first + 1, last), step=1, initial_value=first)
            play_button = self.gui.add_button("Play")
            speed = self.gui.add_slider("Frames / s", min=1.0, max=60.0, step=1.0, initial_value=playback_fps)

        @timeline.on_update
        def _(event) -> None:
            if event.client is not None:  # our own assignments during playback come back with no client
                on_seek(int(timeline.value))

        play_button.on_click(lambda _event: on_play())
        speed.on_update(lambda _event: on_speed(float(speed.value)))
        return ReplayControls(timeline, play_button)


@dataclass(frozen=True)
class ReplayControls:
    """What a replay updates itself: its timeline (a frame index) and its play button's label."""

    timeline: Any  # viser.GuiSliderHandle
    play_button: Any  # viser.GuiButtonHandle


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, bool)


def _format_number(value: float) -> str:
    return f"{value:.1f}" if math.isfinite(value) else "-"
