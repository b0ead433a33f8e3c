"""TUM text files: a run's trajectory written and read back (trajectory_tum.txt, or the npz files' poses of a
run killed before its end; the open chain's before loop closure), a ground-truth trajectory, and the
`rgb.txt` / `depth.txt` frame lists of a TUM RGB-D sequence, each read by one reader and written by one writer.

Its own module because these are text formats shared by the run, the evaluation and the exports, with their
own errors (`TumFileError`, naming the line).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from stream_recon.app.outputs.atomic_writes import atomic_write
from stream_recon.app.outputs.npz_reading import prediction_fields
from stream_recon.app.outputs.rundir import TRAJECTORY_OPEN_TUM, TRAJECTORY_TUM, RunDirError, prediction_files
from stream_recon.models.stream.pose import quat_xyzw_to_rotation, rotation_to_quat_xyzw

logger = logging.getLogger(__name__)


TUM_HEADER = "# timestamp tx ty tz qx qy qz qw"


class TumFileError(ValueError):
    """A TUM text file (trajectory or frame list) that is missing or malformed; says which line."""


def run_trajectory(run_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """Every pose of a run: timestamps [N] and c2w [N, 4, 4], float64, in frame order.

    trajectory_tum.txt when the run wrote it (at its end: every frame, also those saved without an npz,
    --save-predictions keyframes); otherwise, for a run killed before its end, the poses in its npz files.
    """
    run_dir = Path(run_dir)
    trajectory = run_dir / TRAJECTORY_TUM
    if trajectory.is_file():
        return read_tum(trajectory)
    stamps, poses = [], []
    for frame_index, path in prediction_files(run_dir):
        try:
            fields = prediction_fields(path, "timestamp", "c2w")  # depth stays on disk
        except (OSError, ValueError) as exc:
            logger.warning("skipping frame %d: cannot read %s: %s", frame_index, path, exc)
            continue
        stamps.append(fields["timestamp"])
        pose = np.eye(4)
        pose[:3] = np.asarray(fields["c2w"], dtype=np.float64)
        poses.append(pose)
    if not poses:
        raise RunDirError(f"{run_dir} has neither {TRAJECTORY_TUM} nor a readable prediction file: no pose to read")
    return np.asarray(stamps), np.stack(poses)


def run_open_trajectory(run_dir: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """The open chain's poses (TRAJECTORY_OPEN_TUM: where the chunks lay before loop closure corrected
    them): timestamps [N] and c2w [N, 4, 4], float64; None when the run has no such file (no correction
    moved anything). Raises TumFileError for a file that is there but unreadable."""
    path = Path(run_dir) / TRAJECTORY_OPEN_TUM
    if not (path.exists() or path.is_symlink()):
        return None
    return read_tum(path)


def write_tum(path: Path, timestamps: np.ndarray, c2w: np.ndarray) -> None:
    """Poses c2w [N, 3, 4] or [N, 4, 4] at timestamps [N] as a TUM trajectory, atomically.

    A header line, then `timestamp tx ty tz qx qy qz qw` per pose, camera-to-world, w >= 0: timestamps
    to the microsecond, the rest to 9 significant digits (exact for the float32 poses of a run).
    """
    timestamps = np.asarray(timestamps, dtype=np.float64).reshape(-1)
    lines = [TUM_HEADER]
    if len(timestamps):
        c2w = np.asarray(c2w, dtype=np.float64)
        quats = rotation_to_quat_xyzw(c2w[:, :3, :3])
        for timestamp, position, quat in zip(timestamps, c2w[:, :3, 3], quats, strict=True):
            lines.append(f"{timestamp:.6f} " + " ".join(f"{value:.9g}" for value in (*position, *quat)))
    text = "\n".join(lines) + "\n"
    atomic_write(Path(path), lambda f: f.write(text), binary=False)


def read_tum(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A TUM trajectory (`timestamp tx ty tz qx qy qz qw` per line, `#` comments, commas allowed) ->
    timestamps [N] seconds and camera-to-world poses c2w [N, 4, 4], both float64."""
    path = Path(path)
    if path.is_dir():
        inside = next((path / name for name in ("groundtruth.txt", TRAJECTORY_TUM) if (path / name).is_file()), None)
        hint = f" such as {inside}" if inside else " (timestamp tx ty tz qx qy qz qw per line)"
        raise TumFileError(f"{path} is a folder, not a trajectory file: give a TUM trajectory file{hint}")
    if not path.exists():
        raise TumFileError(f"trajectory file {path} does not exist")
    if not path.is_file():  # a FIFO or a device would block the read or never end
        raise TumFileError(f"{path} is not a regular file; give a TUM trajectory file")
    rows = []
    for line_number, text, line in _data_lines(path):
        fields = text.replace(",", " ").split()
        where = f"{path}, line {line_number}"
        if len(fields) != 8:
            raise TumFileError(
                f"{where}: expected 8 values (timestamp tx ty tz qx qy qz qw), found {len(fields)}: {line!r}"
            )
        try:
            values = [float(field) for field in fields]
        except ValueError:
            raise TumFileError(f"{where}: not a number in {line!r}") from None
        if not all(math.isfinite(value) for value in values):
            raise TumFileError(f"{where}: non-finite value in {line!r}")
        if math.hypot(*values[4:]) < 1e-9:
            raise TumFileError(f"{where}: zero quaternion in {line!r}")
        rows.append(values)
    if not rows:
        raise TumFileError(f"{path} holds no poses (expected lines 'timestamp tx ty tz qx qy qz qw')")
    table = np.asarray(rows, dtype=np.float64)  # [N, 8]
    c2w = np.tile(np.eye(4), (len(table), 1, 1))
    c2w[:, :3, :3] = quat_xyzw_to_rotation(table[:, 4:8])
    c2w[:, :3, 3] = table[:, 1:4]
    return table[:, 0], c2w


def read_tum_list(path: Path) -> list[tuple[float, Path]]:
    """A TUM RGB-D list (rgb.txt, depth.txt: `timestamp filename` per line, `#` comments) ->
    [(timestamp, path)], each path relative to the list's folder."""
    path = Path(path)
    entries = []
    for line_number, text, line in _data_lines(path):
        fields = text.split()
        try:
            entries.append((float(fields[0]), path.parent / fields[1]))
        except (ValueError, IndexError):
            raise TumFileError(
                f"{path}, line {line_number}: expected 'timestamp filename', found {line!r}"
            ) from None
    return entries


def _data_lines(path: Path) -> Iterator[tuple[int, str, str]]:
    """(line number, text before any `#`, the whole line stripped) of each line that holds data.

    Raises TumFileError for a file that is missing, unreadable or not text (an image or an archive
    given by mistake), naming the file and what was expected.
    """
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise TumFileError(
            f"{path} is not a text file (byte {error.start} is not UTF-8 text); expected a TUM text file "
            "with one 'timestamp ...' line per entry"
        ) from None
    except OSError as error:
        raise TumFileError(f"cannot read {path}: {error.strerror or error}") from None
    if "\x00" in content:  # UTF-8 decodes some binary files; text never holds NUL
        raise TumFileError(f"{path} is not a text file (it holds NUL bytes); expected a TUM text file")
    for line_number, line in enumerate(content.splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if text:
            yield line_number, text, line.strip()
