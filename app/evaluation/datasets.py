"""Find the sequences under a dataset folder, and read TUM RGB-D frame lists.

Layouts recognised under ROOT (the first rule that applies to a folder wins; nothing below a folder
that is a sequence is searched further):

    ROOT/sequences.txt               manifest: one `path [name]` per line, relative to ROOT; `#` comments.
                                     When present, it is the whole list and nothing else is searched.
    ROOT/.../rgbd_dataset_x/rgb.txt  TUM RGB-D: frames and timestamps from rgb.txt; groundtruth.txt and
                                     depth.txt beside it are used for evaluation when present.
    ROOT/.../clip.mp4                every video file (by extension) is one sequence.
    ROOT/.../frames/000001.png       every folder that directly holds images is one sequence.

Folders named `depth` (depth maps, not frames) and hidden entries are skipped; so is the batch's
own output folder when it lies under ROOT. The order is deterministic (sorted relative paths) and
names are unique: the relative path with `/` replaced by `_`, the video extension dropped, and
`-2`, `-3`, ... appended on a clash. ROOT itself may be one sequence (a video, an image folder or a
TUM folder); it is then named after itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import cv2
import numpy as np

from stream_recon.app.outputs.trajectories import TumFileError, read_tum_list
from stream_recon.app.sources.frames import SourceError
from stream_recon.app.sources.opening import IMAGE_SUFFIXES, VIDEO_SUFFIXES

SequenceKind = Literal["video", "images", "tum"]

MANIFEST_NAME = "sequences.txt"
TUM_FRAME_LIST = "rgb.txt"
TUM_GROUND_TRUTH = "groundtruth.txt"
TUM_DEPTH_LIST = "depth.txt"
# Depth maps are images too, but never frames to reconstruct from.
SKIPPED_FOLDER_NAMES = ("depth",)


class DatasetError(ValueError):
    """A dataset folder or manifest that cannot be turned into a list of sequences."""


@dataclass(frozen=True)
class Sequence:
    """One unit of batch work: what to read and what to compare against."""

    name: str  # unique within the batch; the run directory is OUTPUT/<name>
    source: Path  # the video file, the image folder, or the TUM sequence folder
    kind: SequenceKind
    gt_file: Path | None = None  # TUM trajectory (timestamp tx ty tz qx qy qz qw), camera-to-world
    depth_dir: Path | None = None  # folder with depth.txt (TUM), for depth metrics

    def describe(self) -> str:
        return f"{self.kind} {self.source}"


# --------------------------------------------------------------------------------------------------
# Discovery


def discover_sequences(root: str | Path, *, exclude: tuple[Path, ...] = ()) -> list[Sequence]:
    """Every sequence under `root` (see the module docstring), in a deterministic order with unique names."""
    root = Path(root).expanduser()
    if not root.exists():
        raise DatasetError(f"dataset root {root} does not exist")
    excluded = {path.resolve() for path in exclude}
    if (root / MANIFEST_NAME).is_file():
        return _read_manifest(root)
    own_kind = classify_path(root)
    if own_kind is not None:
        resolved = root.resolve()
        return [
            _make_sequence(root, own_kind, _safe_name(resolved.stem if root.is_file() else resolved.name))
        ]
    found = list(_walk(root, root, excluded))
    if not found:
        raise DatasetError(
            f"no sequences found under {root}: expected video files ({', '.join(VIDEO_SUFFIXES[:5])}, ...), "
            f"folders of images, TUM RGB-D folders with {TUM_FRAME_LIST}, or a {MANIFEST_NAME} manifest"
        )
    return _with_unique_names(
        [(path, kind, _name_from_relative_path(path, root), False) for path, kind in found]
    )


def classify_path(path: Path) -> SequenceKind | None:
    """What kind of sequence `path` is on its own, or None when it is none (e.g. a folder of folders)."""
    if path.is_dir():
        if (path / TUM_FRAME_LIST).is_file():
            return "tum"
        if any(_is_image(entry) for entry in path.iterdir()):
            return "images"
        return None
    if path.is_file() and path.suffix.lower() in VIDEO_SUFFIXES:
        return "video"
    return None


def _is_image(path: Path) -> bool:
    return path.is_file() and not path.name.startswith(".") and path.suffix.lower() in IMAGE_SUFFIXES


def _walk(folder: Path, root: Path, excluded: set[Path]) -> Iterator[tuple[Path, SequenceKind]]:
    """Depth-first over sorted entries, yielding (path, kind); a sequence folder is not searched further."""
    for entry in sorted(folder.iterdir(), key=lambda path: path.name):
        if entry.name.startswith(".") or entry.resolve() in excluded:
            continue
        if entry.is_dir():
            if entry.name.lower() in SKIPPED_FOLDER_NAMES:
                continue
            kind = classify_path(entry)
            if kind is not None:
                yield entry, kind
            else:
                yield from _walk(entry, root, excluded)
        elif entry.suffix.lower() in VIDEO_SUFFIXES:
            yield entry, "video"


def _name_from_relative_path(path: Path, root: Path) -> str:
    relative = path.relative_to(root)
    parts = list(relative.parts)
    if path.is_file():
        parts[-1] = relative.stem
    return _safe_name("_".join(parts))


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "sequence"


def _with_unique_names(entries: list[tuple[Path, SequenceKind, str, bool]]) -> list[Sequence]:
    """Entries (path, kind, name, name_is_explicit) -> sequences with unique names.

    Explicit names (from a manifest) are kept as given; a derived name that clashes with any name gets
    `-2`, `-3`, ... in list order.
    """
    taken = {name for _, _, name, explicit in entries if explicit}
    sequences = []
    for path, kind, name, explicit in entries:
        unique, counter = name, 2
        while not explicit and unique in taken:
            unique, counter = f"{name}-{counter}", counter + 1
        taken.add(unique)
        sequences.append(_make_sequence(path, kind, unique))
    return sequences


def _make_sequence(path: Path, kind: SequenceKind, name: str) -> Sequence:
    if kind != "tum":
        return Sequence(name=name, source=path, kind=kind)
    gt_file = path / TUM_GROUND_TRUTH
    return Sequence(
        name=name,
        source=path,
        kind="tum",
        gt_file=gt_file if gt_file.is_file() else None,
        depth_dir=path if (path / TUM_DEPTH_LIST).is_file() else None,
    )


def _read_manifest(root: Path) -> list[Sequence]:
    """`path [name]` per line. A line that is an existing path as a whole may contain spaces."""
    manifest = root / MANIFEST_NAME
    entries: list[tuple[Path, SequenceKind, str, bool]] = []
    explicit_names: dict[str, int] = {}
    for line_number, line in enumerate(manifest.read_text().splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        where = f"{manifest}, line {line_number}"
        path_text, name = text, None
        if not (root / text).exists() and len(text.split()) > 1:
            path_text, name = (part.strip() for part in text.rsplit(maxsplit=1))
        path = root / path_text
        if not path.exists():
            raise DatasetError(f"{where}: {path} does not exist (paths are relative to {root})")
        kind = classify_path(path)
        if kind is None:
            kind = "video" if path.is_file() else None
        if kind is None:
            raise DatasetError(
                f"{where}: {path} is a folder without images or {TUM_FRAME_LIST}; list a video file, an image "
                "folder or a TUM RGB-D folder"
            )
        if name is not None:
            if name != _safe_name(name):
                raise DatasetError(f"{where}: name {name!r} may only use letters, digits, '.', '_' and '-'")
            if name in explicit_names:
                raise DatasetError(f"{where}: name {name!r} is already used on line {explicit_names[name]}")
            explicit_names[name] = line_number
        entries.append((path, kind, name or _name_from_relative_path(path, root), name is not None))
    if not entries:
        raise DatasetError(f"{manifest} lists no sequences (one path per line, relative to {root})")
    return _with_unique_names(entries)


# --------------------------------------------------------------------------------------------------
# TUM RGB-D frame lists


class TumFrames:
    """The frames of a TUM RGB-D sequence in rgb.txt order: iterate to get (rgb [H, W, 3] uint8, timestamp).

    Timestamps are the rgb.txt ones (seconds, the same clock as groundtruth.txt), so the written
    trajectory associates with the ground truth directly. Iterable more than once; one frame is in
    memory at a time.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.name = self.folder.resolve().name  # for the pipeline's messages
        listing = self.folder / TUM_FRAME_LIST
        if not listing.is_file():
            raise DatasetError(f"{self.folder} is not a TUM RGB-D sequence: {TUM_FRAME_LIST} is missing")
        try:
            self.entries = read_tum_list(listing)
        except TumFileError as error:
            raise DatasetError(str(error)) from None
        if not self.entries:
            raise DatasetError(f"{listing} lists no frames")
        missing = [path for _, path in self.entries if not path.is_file()]
        if missing:
            raise DatasetError(
                f"{listing} lists {len(missing)} frame(s) that do not exist, first {missing[0]}; "
                "the sequence is incomplete (re-extract the archive)"
            )
        timestamps = np.array([timestamp for timestamp, _ in self.entries])
        if np.any(np.diff(timestamps) <= 0):
            bad = int(np.argmax(np.diff(timestamps) <= 0)) + 1
            raise DatasetError(f"{listing}: timestamps must increase, but entry {bad + 1} does not")

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def timestamps(self) -> np.ndarray:
        return np.array([timestamp for timestamp, _ in self.entries])

    def __iter__(self) -> Iterator[tuple[np.ndarray, float]]:
        for timestamp, path in self.entries:
            bgr = cv2.imread(str(path), cv2.IMREAD_COLOR)
            if bgr is None:
                # A source error, so the run keeps the frames before it, as for a damaged video.
                raise SourceError(f"{path} (listed in {TUM_FRAME_LIST}) is not a readable image")
            yield cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB), timestamp
