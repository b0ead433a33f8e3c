"""Query frames placed in a finished run (`stream-recon localise`): what it reads, runs and writes.

From the run: its map (models/loops/saved_map.py: every indexed keyframe's descriptor, features and points),
its settings (run.json: the checkpoint and the model input width) and, per map keyframe, its prediction file:
the keyframe's pose and depth as the run's files hold them, which carry it from the map's world (the stream's
open chain) into the run's (after the stream's solve or a refine: trajectory_tum.txt's), and its picture.

Per query frame (models/loops/localise.py decides): the run's keyframes that look alike are retrieved, and
the model runs on their pictures (`CONTEXT_FRAMES`, best first) and then the query's, as a short stream of
its own: the query's depth and pose then come from a model that saw the place as the run did. A run kept
without pictures (--no-save-images) runs each query alone; its depth scale, the model's own for one frame,
is then fitted by the Sim(3) like the rest of its placement. The query's features, points and verdict
follow; the model does not run for a query nothing of the map looks like.

A run that extended an earlier run's map and was placed in it (`run --map`: its files are in that run's
world) serves that run's keyframes too, so that a query of either recording is placed.

Written into the output folder (RUN/localised/ unless another is given), and nowhere else in the run:
poses_tum.txt (the placed frames, in the run's world, TUM format) and verdicts.json (every query frame:
placed or not, why, and the figures behind it).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from stream_recon.app.options import RunOptions, current_names, resolve_device, resolve_dtype
from stream_recon.app.outputs.json_records import write_json_atomic
from stream_recon.app.outputs.npz_reading import load_prediction, prediction_fields
from stream_recon.app.outputs.rundir import check_run_dir, prediction_files, read_run_info
from stream_recon.app.outputs.trajectories import write_tum
from stream_recon.app.sources.opening import IMAGE_SUFFIXES, list_images, open_source
from stream_recon.app.sources.preprocess import (
    ImageReadError,
    load_image,
    preprocess_frame_uint8,
    upright_rgb,
)
from stream_recon.models import (
    NOT_RETRIEVED,
    LocaliseConfig,
    MapError,
    MapLocaliser,
    SavedMap,
    Verdict,
    keyframe_in_world,
    map_refusal,
    query_of,
    read_map,
)
from stream_recon.models.hub_paths import checkpoint_digest, resolve_checkpoint

LOCALISED_DIR = "localised"  # the default output folder, inside the run
POSES_TUM = "poses_tum.txt"
VERDICTS_JSON = "verdicts.json"
# The run's keyframes a query runs after: two views of the place, the model's scale frames on it, and the
# query's depth in their scale; each more costs a frame's inference.
CONTEXT_FRAMES = 2
CALLER_MODEL = "model passed in by the caller"  # run.json's checkpoint for a run of a caller's model

Progress = Callable[[int, int | None], None]  # (frames done, frames in all where known)
# The keyframes of an earlier run that a placed `--map` run extended are numbered from here, apart from the
# run's own frames (verdicts.json gives them back their own number, with the earlier run's folder).
EARLIER_FRAMES_FROM = 1 << 40


class LocaliseError(ValueError):
    """A run or frames that cannot be localised, in one sentence that says what to do."""


@dataclass(frozen=True)
class QueryImage:
    name: str
    timestamp: float
    rgb: np.ndarray  # [H, W, 3] uint8, upright


@dataclass(frozen=True)
class LocaliseResult:
    output_dir: Path
    verdicts: list[tuple[QueryImage, Verdict]]
    context_note: str | None  # why queries ran without the run's pictures, where they did
    seconds: float
    earlier_run: Path | None = None  # the earlier run whose keyframes served too (a placed `--map` run's)

    @property
    def placed(self) -> int:
        return sum(verdict.placed for _, verdict in self.verdicts)

    def summary_line(self) -> str:
        total = len(self.verdicts)
        line = f"placed {self.placed} of {total} frames"
        refused = Counter(verdict.reason.split(" (")[0] for _, verdict in self.verdicts if not verdict.placed)
        if refused:
            line += f"; {total - self.placed} not placed: " + ", ".join(f"{count} {reason}"
                                                                        for reason, count in refused.most_common())
        return f"{line}; {self.output_dir / POSES_TUM}, {self.output_dir / VERDICTS_JSON} ({self.seconds:.1f} s)"


def localise_run(run_dir: Path, frames: Sequence[str], output_dir: Path | None = None,
                 checkpoint: str | None = None, device: str | None = None, progress: Progress | None = None,
                 console: Console | None = None) -> LocaliseResult:
    """Place every frame of `frames` (picture files, image folders, videos) in `run_dir`'s map (see the module
    docstring); LocaliseError (or SourceError, CheckpointError, OptionsError) for bad input, before the model
    loads."""
    started = time.perf_counter()
    run_dir = Path(run_dir)
    progress = progress or (lambda done, total: None)
    saved = _map_of(run_dir)
    info = read_run_info(run_dir)
    options = _options(info.get("settings", {}), checkpoint, device, run_dir)
    _check_checkpoint(saved, options.checkpoint)
    output_dir = Path(output_dir) if output_dir is not None else run_dir / LOCALISED_DIR
    if output_dir.exists() and not output_dir.is_dir():
        raise LocaliseError(f"{output_dir} is a file: give -o a folder (poses_tum.txt and verdicts.json go in it)")
    sources = [_opened(spec) for spec in frames]  # each readable, before the model loads
    config = LocaliseConfig()
    files = dict(prediction_files(run_dir))
    keyframes = _in_run_world(saved, files, config.closure.min_confidence)
    if not keyframes:
        raise LocaliseError(f"{run_dir} holds no prediction file of its map's keyframes with confident depth: "
                            "run the video again")
    pictures = {keyframe.frame_index: files[keyframe.frame_index] for keyframe in keyframes}
    if load_prediction(files[keyframes[0].frame_index])["image"] is None:
        pictures = {}
    earlier = _extended_map(info, saved)
    if earlier is not None:  # its keyframes numbered apart, each with its prediction file
        files = {EARLIER_FRAMES_FROM + index: path for index, path in prediction_files(earlier.path.parent)}
        numbered = [replace(keyframe, frame_index=EARLIER_FRAMES_FROM + keyframe.frame_index)
                    for keyframe in earlier.keyframes]
        shown = _in_run_world(replace(earlier, keyframes=numbered), files, config.closure.min_confidence)
        keyframes += shown
        if pictures:
            pictures.update({keyframe.frame_index: files[keyframe.frame_index] for keyframe in shown})
    localiser = MapLocaliser(keyframes, config)
    context_note = None if pictures else (f"{run_dir} kept no pictures (--no-save-images): each query ran alone, "
                                        "its depth's scale fitted with its placement")
    runner = _QueryRunner(options, console or Console(stderr=True, quiet=True))
    verdicts = []
    try:
        for query in (image for source in sources for image in source()):
            verdicts.append((query, _placed(query, localiser, runner, pictures, options.image_width)))
            progress(len(verdicts), None)
    finally:
        runner.close()
    result = LocaliseResult(output_dir, verdicts, context_note, time.perf_counter() - started,
                            None if earlier is None else earlier.path.parent)
    _write(result, run_dir)
    return result


def _extended_map(info: dict[str, Any], saved: SavedMap) -> SavedMap | None:
    """The map of the earlier run the run's map (`saved`, `info` its run.json) extended, where the stream was
    placed in it (summary.loop_closure.map: its files are then in that run's world) and that run still holds
    it; else None."""
    if saved.manifest.extends is None:
        return None
    account = info.get("summary", {}).get("loop_closure", {}).get("map") or {}
    if not account.get("placed"):
        return None
    try:
        return read_map(Path(saved.manifest.extends))
    except (MapError, OSError):
        return None


def _map_of(run_dir: Path) -> SavedMap:
    """The run's map, with a keyframe at least."""
    try:
        check_run_dir(run_dir)
        saved = read_map(run_dir)
    except (ValueError, MapError) as error:
        raise LocaliseError(str(error)) from None
    if not saved.keyframes:
        raise LocaliseError(f"{run_dir}'s map holds no complete chunk yet (the run was stopped in its second "
                            "chunk): nothing to place frames in")
    return saved


def _check_checkpoint(saved: SavedMap, checkpoint: str) -> None:
    """The map was made with `checkpoint` (its sha256) and indexed as this version indexes."""
    path = resolve_checkpoint(checkpoint)
    refused = map_refusal(saved, {"name": Path(checkpoint).name, "bytes": path.stat().st_size,
                                  "sha256": checkpoint_digest(path)})
    if refused is not None:
        raise LocaliseError(refused)


def _options(settings: dict[str, Any], checkpoint: str | None, device: str | None, run_dir: Path) -> RunOptions:
    """The run's options for a query's short stream: its model and input width; nothing written, no viewer,
    no loop closure, no compilation (a few frames)."""
    known = set(RunOptions.field_names())
    values = {name: value for name, value in current_names(settings).items() if name in known}
    checkpoint = checkpoint or values.get("checkpoint")
    if checkpoint in (None, CALLER_MODEL):
        raise LocaliseError(f"{run_dir}'s run.json names no checkpoint file: give the one it was made with "
                            "(--checkpoint)")
    values.update(checkpoint=checkpoint, device=device or "auto", dtype="auto", attention="auto", compile="off",
                  warm_up="off", viewer=False, keep_viewer=False, loop_closure="off", mask_sky=False, mask_dir=None,
                  gpu_memory=None, max_frames=None, start=0, stride=1, fps=None, rotate=0)
    return RunOptions(**values)


def _opened(spec: str) -> Callable[[], Iterator[QueryImage]]:
    """The frames of one FRAMES argument, read when asked: a picture, every picture of a folder, or a video's
    frames. Its opening is checked now (SourceError, LocaliseError)."""
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() in IMAGE_SUFFIXES:
        pictures = [path]
    elif path.is_dir():
        pictures = list_images(path)
        if not pictures:
            raise LocaliseError(f"folder {path} holds no pictures (looked for {', '.join(IMAGE_SUFFIXES)})")
    else:
        open_source(spec).close()  # a video: its own errors (a missing file, one that does not decode)
        return lambda: _video_frames(spec)
    return lambda: _picture_frames(pictures)


def _picture_frames(pictures: Sequence[Path]) -> Iterator[QueryImage]:
    for number, picture in enumerate(pictures):
        try:
            rgb = np.asarray(upright_rgb(load_image(picture)), dtype=np.uint8)
        except ImageReadError as error:
            raise LocaliseError(str(error)) from None
        yield QueryImage(picture.name, float(number), rgb)


def _video_frames(spec: str) -> Iterator[QueryImage]:
    source = open_source(spec)
    try:
        for frame in source:
            yield QueryImage(f"{Path(spec).name}#{frame.source_index}", frame.timestamp, frame.rgb)
    finally:
        source.close()


def _in_run_world(saved: SavedMap, files: dict[int, Path], min_confidence: float) -> list:
    """The map's keyframes carried into the run's world, each by what its prediction file shows (its pose
    there, its confident depth's median: a solve or a refine moved the file by a Sim(3), depth scaled).
    Keyframes without a file, or without confident depth, are left out."""
    moved = []
    for keyframe in saved.keyframes:
        path = files.get(keyframe.frame_index)
        if path is None:
            continue
        record = prediction_fields(path, "c2w", "depth", "depth_conf")  # (not the picture: read when a query needs it)
        depth, confidence = record["depth"], record["depth_conf"]
        sure = depth[(confidence >= min_confidence) & (depth > 0) & np.isfinite(depth)]
        placed = keyframe_in_world(keyframe, record["c2w"], float(np.median(sure)) if sure.size else float("nan"))
        if placed is not None:
            moved.append(placed)
    return moved


class _QueryRunner:
    """The run's model over a query's short stream: the context pictures, then the query."""

    def __init__(self, options: RunOptions, console: Console):
        # torch loads with the model, once every input has been checked: a bad one is refused in a fraction of
        # a second, not after torch's import (~1 s of CPU, 2.5 s on a 2-core machine)
        from stream_recon.app.run.loading import build_engine, load_model_for

        device = resolve_device(options.device)
        model = load_model_for(options, device, console, compile=False)
        self.engine = build_engine(model, options, device, resolve_dtype(options.dtype, device), console)

    def predict(self, context: Sequence[np.ndarray], image: np.ndarray) -> Any:
        """The query's prediction (FramePrediction) after `context` ([H, W, 3] uint8 each, the query's size)."""
        self.engine.reset()
        predictions = []
        for picture in context:
            predictions += self.engine.push(np.ascontiguousarray(picture.transpose(2, 0, 1)))
        predictions += self.engine.push(image)
        predictions += self.engine.finish()
        return [prediction for prediction in predictions if prediction.frame_index == len(context)][-1]

    def close(self) -> None:
        self.engine.close()


def _placed(query: QueryImage, localiser: MapLocaliser, runner: _QueryRunner, pictures: dict[int, Path],
            image_width: int) -> Verdict:
    """The query's verdict; `pictures`: the prediction file of each keyframe whose picture the run kept."""
    image = preprocess_frame_uint8(query.rgb, image_width)  # [3, H, W], as the run's frames
    nearest = localiser.nearest_to_picture(image.transpose(1, 2, 0))
    if not nearest:
        return Verdict(False, NOT_RETRIEVED)
    context = [load_prediction(pictures[candidate.frame_index])["image"] for candidate in nearest[:CONTEXT_FRAMES]
               if candidate.frame_index in pictures]
    # a picture of another size than the query's: the query runs without it
    context = [picture for picture in context if picture is not None and picture.shape[:2] == image.shape[1:]]
    return localiser.place(query_of(runner.predict(context, image), localiser.config))


def _write(result: LocaliseResult, run_dir: Path) -> None:
    output_dir = result.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    placed = [(query, verdict) for query, verdict in result.verdicts if verdict.placed]
    write_tum(output_dir / POSES_TUM, np.array([query.timestamp for query, _ in placed]),
              np.array([verdict.c2w for _, verdict in placed]).reshape(-1, 3, 4))
    write_json_atomic(output_dir / VERDICTS_JSON, {
        "run": str(run_dir), "placed": result.placed, "frames": len(result.verdicts), "context": result.context_note,
        "queries": [{"name": query.name, "timestamp": query.timestamp, **_keyframe_named(verdict, result.earlier_run),
                     "c2w": None if verdict.c2w is None else np.round(verdict.c2w, 9).tolist()}
                    for query, verdict in result.verdicts]})


def _keyframe_named(verdict: Verdict, earlier_run: Path | None) -> dict[str, Any]:
    """A verdict's JSON; a keyframe of the earlier run by its own number there, with that run's folder."""
    out = verdict.as_json()
    if verdict.keyframe is not None and verdict.keyframe >= EARLIER_FRAMES_FROM:
        out.update(keyframe=verdict.keyframe - EARLIER_FRAMES_FROM, keyframe_run=str(earlier_run))
    return out
