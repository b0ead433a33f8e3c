"""Loop closure in a run: whether it runs (`--loop-closure`), and the sink that feeds it and hands its
corrections on.

The loop closer itself (models/loop_closure.py) works beside the stream; this sink gives it each chunk's
odometry and every emission, passes each new solve to the live viewer, and at the end of the run waits
for the last solve so that the writer can correct the run directory. A failure of loop closure never
fails the run: it is logged, recorded in run.json, and the open chain stands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stream_recon.app.options import OptionsError, RunOptions
from stream_recon.app.outputs.pointcloud import read_ply
from stream_recon.app.outputs.rundir import POINTS_PLY, TRAJECTORY_OPEN_TUM
from stream_recon.models import MapError, checkpoint_refusal, read_manifest, write_manifest
from stream_recon.models.supervision import CHILDREN, Deadline

logger = logging.getLogger(__name__)

# The extended map's points the viewer draws: a quarter of its live cap (LiveViewer's max_total_points)
EARLIER_CLOUD_POINTS = 500_000


def third_chunk_start(options: RunOptions) -> int:
    """The first frame a third chunk can start at: a loop joins chunks two or more apart, so a stream that
    ends before it has no loop to close (each chunk starts `overlap` frames before the last one's end)."""
    return 2 * (options.chunk_frames - options.overlap)


def loop_closure_cannot_help(options: RunOptions, estimated_length: int | None) -> str | None:
    """A warning for `--loop-closure on` over a source known to end before a third chunk (`auto` is off
    there, and run.json says why), or None."""
    if options.loop_closure != "on" or estimated_length is None or estimated_length > third_chunk_start(options):
        return None
    return (f"--loop-closure on: the stream's {estimated_length} frames never reach a third chunk (frame "
            f"{third_chunk_start(options)} at --chunk-frames {options.chunk_frames}), and a loop joins chunks "
            "two or more apart, so loop closure cannot correct this stream; --loop-closure off skips it")


def loop_closure_wanted(options: RunOptions, estimated_length: int | None) -> tuple[bool, str]:
    """Whether a run closes loops, and why (for run.json). `on` without the pose graph's library is an
    OptionsError; `auto` is on unless the library is missing or the source is known to end before its
    third chunk (a loop joins chunks two or more apart: chunk 2 starts no earlier than frame
    2 * (chunk_frames - overlap))."""
    if options.loop_closure == "off":
        return False, "off (--loop-closure off)"
    missing = pose_graph_library_problem()
    if missing is not None:
        if options.loop_closure == "on":
            raise OptionsError(f"--loop-closure on needs gtsam, the pose graph's library, but {missing}: "
                               f"{missing.remedy} (or --loop-closure off)")
        if missing.broken:  # installed but broken: worth a line, unlike a choice not to install it
            logger.warning("loop closure is off: %s; %s", missing, missing.remedy)
        return False, f"off ({missing})"
    if options.extend_map is not None:  # a loop to the map joins any chunk, the first one too
        return True, "on (--map)"
    third_chunk = third_chunk_start(options)
    if options.loop_closure == "auto" and estimated_length is not None and estimated_length <= third_chunk:
        return False, f"off (auto: {estimated_length} frames never reach a third chunk, at frame {third_chunk})"
    return True, "on" if options.loop_closure == "on" else "on (auto)"


@dataclass(frozen=True)
class LibraryProblem:
    """Why gtsam cannot serve loop closure here: `broken` when it is installed but its import fails (a
    wheel built for another platform, a missing shared library), else it is not installed."""

    text: str
    broken: bool

    def __str__(self) -> str:
        return self.text

    @property
    def remedy(self) -> str:
        """What to run: a plain install does nothing where a broken one is installed already."""
        return "pip install --force-reinstall gtsam" if self.broken else "pip install gtsam"


def pose_graph_library_problem() -> LibraryProblem | None:
    """Why gtsam cannot serve loop closure here, or None when it imports."""
    if importlib.util.find_spec("gtsam") is None:
        return LibraryProblem("gtsam is not installed", broken=False)
    try:
        importlib.import_module("gtsam")
    except Exception as error:  # noqa: BLE001 - any failure of a native import means the same to the user
        return LibraryProblem(f"gtsam does not import ({type(error).__name__}: {error})", broken=True)
    return None


def check_extended_map(options: RunOptions, output_dir: Path) -> None:
    """--map RUN's checks before the model loads (OptionsError, one line): RUN holds a map this version reads,
    made with the run's checkpoint (by name and size: its digest is not known before the stream), and the new run goes elsewhere (RUN is never written)."""
    if options.extend_map is None:
        return
    if options.loop_closure == "off":
        raise OptionsError("--map extends an earlier map through loop closure: leave out --loop-closure off")
    earlier = Path(options.extend_map)
    if not earlier.is_dir():
        raise OptionsError(f"--map {earlier}: no such run folder; give the output folder of an earlier run")
    if earlier.resolve() == Path(output_dir).resolve():
        raise OptionsError(f"--map {earlier} is the output folder too: the new run would replace the map it extends; "
                           "give another --output")
    try:
        manifest = read_manifest(earlier)
    except MapError as error:
        raise OptionsError(f"--map: {error}") from None
    if options.checkpoint is None:
        return
    wanted = Path(options.checkpoint)
    refused = checkpoint_refusal(manifest.checkpoint, {"name": wanted.name,
                                                       "bytes": wanted.stat().st_size if wanted.is_file() else None},
                                 earlier)
    if refused is not None:
        raise OptionsError(f"--map: {refused}")


@dataclass(frozen=True)
class MapPlan:
    """Where a run's saved map goes (models/loops/saved_map.py) and what its manifest says: the checkpoint
    (`name`, `path` or None for a caller's model) and the chunk settings; `digest`: the checkpoint's sha256 once
    hashed (None while not), asked as the stream goes so that the manifest gets it as soon as it is known."""

    folder: Path
    checkpoint_name: str | None
    checkpoint_path: Path | None
    chunk_frames: int
    overlap: int
    digest: Callable[[], str | None] = lambda: None
    extends: Path | None = None  # the earlier run whose map the stream extends (--map), only read

    def extended(self) -> tuple[str, bool] | None:
        """The map the stream extends, for the loop-closure child: its run's folder and whether that run's
        outputs are corrected by its last solve (they are its map's frame: SavedMap.placement)."""
        if self.extends is None:
            return None
        return str(self.extends), (self.extends / TRAJECTORY_OPEN_TUM).is_file()

    def checkpoint(self) -> dict[str, Any]:
        size = None
        if self.checkpoint_path is not None:
            with contextlib.suppress(OSError):
                size = self.checkpoint_path.stat().st_size
        return {"name": self.checkpoint_name, "bytes": size, "sha256": self.digest()}


class LoopClosureSink:
    """Feeds the loop-closure process from the stream: a chunk's odometry before its first emission, then
    every emission; new corrections go to the viewer (if any) as they come. Nothing here waits but
    `finish`, with a deadline. Disabled, it only records why (`reason`) for run.json; a loop closer that
    goes down (models/loops/process.py) turns loop closure off for the rest of the run, and the open
    chain with every correction accepted so far stands."""

    def __init__(self, engine: Any, viewer: Any = None, *, enabled: bool, reason: str, config: Any = None,
                 saved_map: MapPlan | None = None) -> None:
        """config: a models.loops.closer.LoopClosureConfig (None: its defaults); saved_map: where the loop
        closer writes the run's map as it goes (None: no map)."""
        if enabled and not hasattr(engine, "chunk_links"):
            enabled, reason = False, "off (the engine streams no chunks)"
        self.closer = None
        self.engine = engine
        self.viewer = viewer
        self.reason = reason
        self.error: str | None = None
        self._links = 0
        self.end_wait_s: float | None = None  # how long the end of the run waited for the child's last word
        self.wait_cut_short = False  # a signal ended that wait before the child's last word
        self.saved_map = saved_map
        self._manifest: Any = None  # the map's manifest as written, rewritten once the checkpoint is hashed
        self._map_started = False  # the map's folder is begun at the first frame (_start_map)
        if enabled:
            self._start(config)
        if self.closer is not None and viewer is not None and saved_map is not None and saved_map.extends is not None:
            self._show_earlier_cloud(saved_map.extends / POINTS_PLY)

    def _show_earlier_cloud(self, path: Path) -> None:
        """The earlier run's points.ply in the viewer, before the stream (a missing or damaged one: a warning)."""
        try:
            self.viewer.show_earlier_map(*read_ply(path, EARLIER_CLOUD_POINTS))
        except Exception as error:  # noqa: BLE001 - the picture of the map is a help, never a reason to stop
            logger.warning("the viewer does not show the extended map's points: %s: %s", path, error)

    def _start(self, config: Any) -> None:
        try:  # (imported here: the closer needs gtsam, which a run without loop closure may lack)
            from stream_recon.models.loops import closer, process

            config = config or closer.LoopClosureConfig()
            if self.saved_map is not None:
                plan = self.saved_map
                self._manifest = closer.map_manifest(config, plan.checkpoint(), plan.chunk_frames, plan.overlap)
                if plan.extends is not None:
                    self._manifest = dataclasses.replace(self._manifest, extends=str(plan.extends.resolve()))
            self.closer = process.LoopClosureProcess(config, extends=None if self.saved_map is None
                                                     else self.saved_map.extended())
            self.finish_s = process.FINISH_S  # how long the end of the run waits for the child's last word
        except Exception as failure:  # noqa: BLE001 - loop closure is an improvement, never a reason to stop
            self.error = f"it could not start: {type(failure).__name__}: {failure}"
            logger.warning("loop closure is off for the rest of the run: %s", self.error)

    def _start_map(self) -> None:
        """The map's folder begun at the first frame, never sooner: until the run writer has taken the folder
        (its sink comes first) an earlier run's files there, its map among them, are left as they were, so
        that a run stopped before its first frame leaves the earlier one whole."""
        self._map_started = True
        try:
            write_manifest(self.saved_map.folder, self._manifest)
        except OSError as error:
            logger.warning("the run's map is not saved: %s", error)
            self._manifest = None
            return
        self.closer.record_map(str(self.saved_map.folder))

    def _hashed(self) -> None:
        """The map's manifest with the checkpoint's sha256, once known (written once)."""
        if (self._manifest is None or not self._map_started or self._manifest.checkpoint.get("sha256")
                or self.saved_map.checkpoint_path is None):
            return
        digest = self.saved_map.digest()
        if digest is None:
            return
        self._manifest = dataclasses.replace(self._manifest, checkpoint={**self._manifest.checkpoint, "sha256": digest})
        with contextlib.suppress(OSError):
            write_manifest(self.saved_map.folder, self._manifest)

    @property
    def running(self) -> bool:
        return self.closer is not None and self.closer.helper.is_up

    def helpers(self) -> dict[str, Any]:
        """Loop closure's child, where it started, and the monitor of children watching it
        (models.supervision.Helper, by run.json's name)."""
        return {} if self.closer is None else {"loop_closure": self.closer.helper, **CHILDREN.helpers()}

    def on_frame(self, pred: Any, stats: dict) -> None:
        if not self.running:
            return
        if self._manifest is not None and not self._map_started:
            self._start_map()
        links = self.engine.chunk_links
        for link in links[self._links:]:
            self.closer.add_link(link)
        self._links = len(links)
        self.closer.add_prediction(pred)
        self._show(self.closer.take_corrections())
        self._hashed()

    def close(self, status: str) -> None:
        if self.closer is not None:
            self.closer.close()

    def finish(self, status: str, stop_now: Callable[[], bool] = lambda: False) -> Any:
        """The final ChunkCorrections (None when loop closure never ran): a complete or failed run waits
        for the child's last word up to FINISH_S (or until `stop_now`), an interrupted one takes what is
        solved already."""
        if self.closer is None:
            return None
        started = time.monotonic()
        if status == "interrupted" or not self.running:
            self.closer.take_corrections()
            self.closer.close()
            corrections = self.closer.corrections
        else:
            corrections = self.closer.finish(Deadline(self.finish_s), self._stop_waiting(stop_now))
        self.end_wait_s = round(time.monotonic() - started, 3)
        extension = self.closer.summary().get("map")
        if extension is not None and not extension["placed"]:
            logger.warning("%s", extension["note"])
        self._hashed()
        self._show(corrections, force=True)
        return corrections

    def _stop_waiting(self, stop_now: Callable[[], bool]) -> Callable[[], bool]:
        """`stop_now`, asked only while the child has not given its last word: its first yes cuts the wait
        short."""
        def stop() -> bool:
            if stop_now():
                self.wait_cut_short = True
            return self.wait_cut_short

        return stop

    @property
    def failure(self) -> str | None:
        """Why loop closure went off during the run, if it did."""
        if self.error is not None:
            return self.error
        return None if self.closer is None else self.closer.helper.down_reason

    def summary(self) -> dict[str, Any]:
        summary = {"mode": self.reason, "error": self.failure}
        if self.closer is not None:
            summary.update(self.closer.summary())
            summary["end_wait_s"] = self.end_wait_s  # seconds, to the ms; None when the run never came to its end
        return summary

    def _show(self, corrections: Any, force: bool = False) -> None:
        if corrections is not None and self.viewer is not None and (force or not corrections.is_identity):
            self.viewer.apply_corrections(corrections)
