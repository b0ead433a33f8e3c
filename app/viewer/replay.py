"""Replaying a run directory in the browser: the index of its frames, the timeline, play/pause.

The replay reads `RUN_DIR/predictions/NNNNNN.npz` (one file per frame, the last emission of each frame
index) and feeds them to the same `LiveViewer` the live run uses, so the scene, the caps and the GUI are
the same; the replay's own folder (timeline, play, speed) is one of the viewer's control panel
(app/viewer/control_panel.py), and this module keeps the playback. Moving the timeline to frame t shows
the trajectory up to t and the newest keyframes up to t.

The files hold the corrected world when loop closure moved the chunks (the writer applies the
corrections), so the map needs no move; the accepted loops that run.json lists are drawn between their
two cameras, each once the timeline has reached both.

Staying interactive on long runs. At start only the small arrays of every file are read (index, keyframe
flag, c2w), so the timeline knows the whole trajectory at once. A seek truncates or extends the scene,
draws the frame at the timeline position and returns; a loader thread then brings in the keyframes that
can be on screen (at most `max_keyframes`), newest first, and a newer seek supersedes it. The viewer's caps
bound what the browser holds whatever the length of the run.

Of 3,000 frames at the model's input size, every one a keyframe, under the default caps: opening takes about
1.6 s, a seek at most 0.3 s, the 300 keyframes behind it about 30 ms each (docs/performance-log.md, "replay";
`test_replay_of_3000_frames_stays_under_the_caps` repeats it with small frames and tighter caps). Its two
threads are one helper's (REPLAY_POLICY): one that raises stops the playback, the viewer still serving.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from stream_recon.app.options import VIEWER_HOST, VIEWER_PORT
from stream_recon.app.outputs.npz_reading import load_prediction, prediction_fields
from stream_recon.app.outputs.rundir import (
    PREDICTIONS_DIR,
    RunDirError,
    loop_closure_summary,
    prediction_files,
    read_run_info,
)
from stream_recon.app.viewer import LiveViewer
from stream_recon.models import FramePrediction
from stream_recon.models.loops.corrections import ChunkCorrections, LoopRecord
from stream_recon.models.supervision import Helper, HelperPolicy, WhenDown, WhenFull, start_supervised_thread

logger = logging.getLogger(__name__)
# a newer seek supersedes what the loader was bringing in (latest wins)
REPLAY_POLICY = HelperPolicy("the replay's playback", WhenFull.LATEST, WhenDown.TURN_OFF, stall_s=60.0)


@dataclass(frozen=True)
class RunIndex:
    """What the timeline needs about every frame of a run, without its depth maps.

    paths [S] npz files in frame order; frame_indices [S]; is_keyframe [S]; c2w [S, 3, 4].
    """

    paths: tuple[Path, ...]
    frame_indices: np.ndarray
    is_keyframe: np.ndarray
    c2w: np.ndarray

    @property
    def num_frames(self) -> int:
        return len(self.paths)


def index_run(run_dir: Path) -> RunIndex:
    """Read the frame index, keyframe flag and pose of every prediction file in `run_dir`.

    Unreadable files (the last one of a killed run, say) are skipped with a warning, as `iter_run` does.
    """
    paths = [path for _, path in prediction_files(run_dir)]
    frame_indices, keyframe_flags, poses, readable = [], [], [], []
    for path in paths:
        try:
            fields = prediction_fields(path, "frame_index", "is_keyframe", "c2w")  # depth stays on disk
            frame_index, is_keyframe = int(fields["frame_index"]), bool(fields["is_keyframe"])
            c2w = np.asarray(fields["c2w"], dtype=np.float32).reshape(3, 4)
        except (OSError, ValueError) as error:
            logger.warning("skipping %s: %s", path, error)
            continue
        frame_indices.append(frame_index)
        keyframe_flags.append(is_keyframe)
        poses.append(c2w)
        readable.append(path)
    if not readable:
        raise RunDirError(f"{Path(run_dir) / PREDICTIONS_DIR} holds no readable prediction files (NNNNNN.npz)")
    order = np.argsort(frame_indices, kind="stable")
    return RunIndex(
        paths=tuple(readable[i] for i in order),
        frame_indices=np.asarray(frame_indices)[order],
        is_keyframe=np.asarray(keyframe_flags)[order],
        c2w=np.stack(poses)[order],
    )


def recorded_loops(run_info: dict[str, Any]) -> tuple[LoopRecord, ...]:
    """The loops run.json lists (`summary.loop_closure.loops`, each a LoopRecord.as_json); none for a run
    without the key (loop closure off, or written before it existed). An entry missing a field is skipped
    with a warning."""
    closure = loop_closure_summary(run_info)
    fields = {field.name for field in dataclasses.fields(LoopRecord)}
    loops = []
    for entry in closure.get("loops") or []:
        try:
            loops.append(LoopRecord(**{key: value for key, value in entry.items() if key in fields}))
        except (AttributeError, TypeError) as error:
            logger.warning("skipping a loop in run.json: %s", error)
    return tuple(loops)


def load_frame(path: Path) -> FramePrediction:
    """One prediction file (DESIGN.md §5, read by npz_reading's `load_prediction`) as a FramePrediction."""
    record = load_prediction(path)
    depth = np.asarray(record["depth"], dtype=np.float32)
    if record["sky_mask"] is not None:  # a masked run's dropped pixels (app.outputs.masks) have no depth to draw
        depth = np.where(record["sky_mask"], np.float32(np.nan), depth)
    return FramePrediction(
        frame_index=record["frame_index"],
        timestamp=record["timestamp"],
        frame_type=record["frame_type"],
        pose_enc=np.asarray(record["pose_enc"], dtype=np.float32),
        c2w=np.asarray(record["c2w"], dtype=np.float32),
        intrinsics=np.asarray(record["intrinsics"], dtype=np.float32),
        depth=depth,
        depth_conf=np.asarray(record["depth_conf"], dtype=np.float32),
        image=None if record["image"] is None else np.asarray(record["image"], dtype=np.uint8),
        chunk_index=record["chunk_index"],
    )


class Replay:
    """Drives a LiveViewer from a run directory: timeline slider, play/pause, playback speed."""

    def __init__(self, index: RunIndex, viewer: LiveViewer, playback_fps: float = 10.0) -> None:
        self.index = index
        self.viewer = viewer
        self.position = -1  # index into `index.paths` of the newest frame on screen
        self._seek_lock = threading.Lock()
        self._playing = threading.Event()
        self._stopping = threading.Event()
        self._playback_fps = playback_fps
        # Keyframe loading runs on its own thread, newest first, so that a seek returns at once and the
        # part of the scene around the timeline position appears first. A newer seek supersedes it.
        self._generation = 0
        self._to_load: list[int] = []  # positions, newest first
        self._load_requested = threading.Event()
        self._loader_idle = threading.Event()
        self._loader_idle.set()
        first, last = int(index.frame_indices[0]), int(index.frame_indices[-1])
        # the timeline counts the run's frame indices (those of run.json, the progress and the files), not
        # positions among the saved files: a run saved with --save-predictions keyframes has gaps
        self._controls = viewer.panel.add_replay_folder(
            first, last, playback_fps, on_seek=self._seek_from_browser, on_play=self._toggle_play,
            on_speed=self._set_speed,
        )
        saved = "" if last - first + 1 == index.num_frames else f" (frames {first}-{last}; the others have no file)"
        viewer.set_status(f"**replay** of {index.num_frames} frames{saved}")
        self.helper = Helper(REPLAY_POLICY)
        self._threads = [start_supervised_thread(self.helper, loop, name)
                         for loop, name in ((self._play_loop, "replay-player"), (self._load_loop, "replay-loader"))]

    def seek(self, position: int) -> None:
        """Show the run up to frame `position` (0-based, in frame order); keyframes arrive shortly after."""
        position = int(np.clip(position, 0, self.index.num_frames - 1))
        with self._seek_lock:
            if position == self.position:
                return
            self._generation += 1
            if position < self.position:
                # Poses up to `position` are already on screen. Keyframes the caps dropped earlier may fit
                # again once the newer ones are gone, so every candidate up to `position` is checked.
                self.viewer.truncate_after(int(self.index.frame_indices[position]))
                self.viewer.flush()
                first_new = 0
            else:
                first_new = self.position + 1
                new_positions = range(first_new, position + 1)
                self.viewer.push_poses(
                    {int(self.index.frame_indices[p]): self.index.c2w[p] for p in new_positions}
                )
            # The frame at the timeline position goes first: it is the current camera.
            self.viewer.on_frame(load_frame(self.index.paths[position]), {})
            self._to_load = self._keyframes_to_load(first_new, position - 1)
            self.position = position
            self._loader_idle.clear()
            self._load_requested.set()
        frame_index = int(self.index.frame_indices[position])
        if self._controls.timeline.value != frame_index:
            self._controls.timeline.value = frame_index

    def position_of(self, frame_index: int) -> int:
        """The position of the newest saved frame at or before `frame_index` (a timeline value)."""
        return max(0, int(np.searchsorted(self.index.frame_indices, frame_index, side="right")) - 1)

    def _keyframes_to_load(self, first: int, last: int) -> list[int]:
        """Positions in [first, last] of the newest keyframes that can be on screen, newest first."""
        positions = np.flatnonzero(self.index.is_keyframe[first : last + 1]) + first
        return [int(p) for p in positions[::-1][: self.viewer.max_keyframes]]

    def _load_loop(self) -> None:
        while not self._stopping.is_set():
            self._load_requested.wait()
            self._load_requested.clear()
            with self._seek_lock:
                generation, positions = self._generation, self._to_load
            on_screen = self.viewer.shown_keyframes()
            for p in positions:
                if self._stopping.is_set() or self._generation != generation:
                    break
                if int(self.index.frame_indices[p]) in on_screen:
                    continue
                # Stay a few frames ahead of the viewer: its pending queue keeps only the poses of what
                # overflows, and this loader would overflow it with the newest keyframes first.
                while self.viewer.num_pending > 8 and not self._stopping.is_set():
                    time.sleep(0.005)
                try:
                    prediction = load_frame(self.index.paths[p])
                except (OSError, ValueError) as error:  # damaged or removed since indexing: leave it out
                    logger.warning("skipping %s: %s", self.index.paths[p], error)
                    continue
                with self._seek_lock:  # a seek in between may have truncated past this frame
                    if self._generation != generation:
                        break
                    self.viewer.on_frame(prediction, {})
            with self._seek_lock:
                if self._generation == generation:
                    self._loader_idle.set()

    def play(self) -> None:
        if self.position >= self.index.num_frames - 1:
            self.seek(0)
        self._playing.set()
        self._controls.play_button.label = "Pause"

    def pause(self) -> None:
        self._playing.clear()
        self._controls.play_button.label = "Play"

    def stop(self) -> None:
        self._stopping.set()
        self._playing.set()
        self._load_requested.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def _play_loop(self) -> None:
        while not self._stopping.is_set():
            self._playing.wait()
            if self._stopping.is_set():
                return
            started = time.perf_counter()
            if self.position >= self.index.num_frames - 1:
                self.pause()
                continue
            self.seek(self.position + 1)
            self._stopping.wait(max(0.0, 1.0 / self._playback_fps - (time.perf_counter() - started)))

    def _seek_from_browser(self, frame_index: int) -> None:
        self.pause()
        self.seek(self.position_of(frame_index))

    def _toggle_play(self) -> None:
        self.pause() if self._playing.is_set() else self.play()

    def _set_speed(self, frames_per_second: float) -> None:
        self._playback_fps = frames_per_second


def start_replay(run_dir: Path, host: str = VIEWER_HOST, port: int = VIEWER_PORT, **viewer_options) -> Replay:
    """Index `run_dir`, start a viewer and show the whole run (the timeline at its last frame). Points are
    shown with the run's own confidence threshold (run.json) unless viewer_options say otherwise, and the
    accepted loops run.json lists are drawn."""
    index = index_run(run_dir)
    run_info = read_run_info(run_dir)
    recorded = run_info.get("summary", {}).get("points", {}).get("conf_threshold")
    if isinstance(recorded, (int, float)):
        viewer_options.setdefault("min_confidence", float(recorded))
    viewer = LiveViewer(host, port, keep_serving=True, inference_controls=False, **viewer_options)
    loops = recorded_loops(run_info)
    if loops:  # no chunk moves: the files are corrected already
        viewer.apply_corrections(ChunkCorrections(by_chunk={}, loops=loops))
    replay = Replay(index, viewer)
    replay.seek(index.num_frames - 1)
    return replay
