"""The run directory: its file names, the per-frame npz schema, when a folder holds a run, and reading one back.

Layout (DESIGN.md §5)::

    RUN_DIR/
      run.json                  status running -> complete | interrupted | failed, settings, summary
      predictions/000000.npz    one per frame, written atomically as the frame becomes final
      trajectory_tum.txt        timestamp tx ty tz qx qy qz qw (camera-to-world), written at close
      trajectory_open_tum.txt   the same before loop closure corrected it, when a correction moved anything
      points.ply                confidence-filtered, voxel-downsampled cloud, written at close
      map/                      the saved map, written as the run goes by its loop closer (models/loops/saved_map.py)
      eval.json                 `stream-recon eval` (and batch) scores, when evaluated

The TUM text formats live here too: the run's trajectory, a ground-truth trajectory and the `rgb.txt` /
`depth.txt` frame lists of a TUM RGB-D sequence are read by one reader each and written by one writer.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import shutil
import stat
import tempfile
import threading
import zipfile
from collections.abc import Callable, Collection, Iterator
from itertools import count
from pathlib import Path
from typing import Any

import numpy as np

from stream_recon.app.outputs.npz_schema import (
    HALVABLE_FIELDS,
    IMAGE_FIELD,
    PREDICTION_FIELDS,
    RENAMED_FIELDS,
    SKY_MASK_FIELD,
)
from stream_recon.app.outputs.npz_schema import (
    prediction_arrays as prediction_arrays,  # scripts import it from here
)
from stream_recon.app.stopping import interrupts_held
from stream_recon.models import MAP_DIR
from stream_recon.models.stream.pose import quat_xyzw_to_rotation, rotation_to_quat_xyzw

logger = logging.getLogger(__name__)

RUN_FORMAT = "stream-recon-run/1"
FINAL_STATUSES = ("complete", "interrupted", "failed")

PREDICTIONS_DIR = "predictions"
RUN_JSON = "run.json"
TRAJECTORY_TUM = "trajectory_tum.txt"
# Written when loop closure moved any chunk: the trajectory as the open chain of chunks placed it, before
# the correction (trajectory_tum.txt, the npz files and points.ply are corrected).
TRAJECTORY_OPEN_TUM = "trajectory_open_tum.txt"
POINTS_PLY = "points.ply"
EVAL_JSON = "eval.json"
EXPORTS_DIR = "exports"  # `stream-recon export` writes here unless told otherwise
BATCH_MARKER = ".complete"  # `batch` marks a finished sequence's run directory with it
TUM_HEADER = "# timestamp tx ty tz qx qy qz qw"

# Only these names are predictions; temp files (".000012.npz.<pid>.<thread>.<n>.tmp") and the rest are ignored.
_PREDICTION_NAME = re.compile(r"^(\d{6,})\.npz$")


class OutputDirError(ValueError):
    """The output directory cannot be created, written, or already holds another run."""


class RunDirError(ValueError):
    """A run directory to read is missing or holds no predictions."""


class TumFileError(ValueError):
    """A TUM text file (trajectory or frame list) that is missing or malformed; says which line."""


def prediction_path(run_dir: Path, frame_index: int) -> Path:
    return Path(run_dir) / PREDICTIONS_DIR / f"{frame_index:06d}.npz"


# --------------------------------------------------------------------------------------------------
# Atomic file writes


_temp_counter = count()


class OutputPathError(OSError):
    """A file to write whose path is taken by something that is not a regular file (a FIFO, a device, a
    socket, a folder): writing would replace it, so nothing is written."""


_FILE_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def file_to_write(path: Path) -> Path:
    """The file that writing `path` replaces: `path` itself, or the file a symlink there points to (written
    through, the link kept). Raises OutputPathError when that is not a regular file (or nothing yet)."""
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()
    try:
        mode = path.stat().st_mode
    except OSError:  # nothing there yet (or nothing that can be looked at: the write itself will say)
        return path
    if stat.S_ISREG(mode):
        return path
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
    raise OutputPathError(f"{path} is {kind}, not a regular file; nothing was written to it: choose a file path")


def atomic_write(path: Path, write: Callable[[Any], None], *, binary: bool) -> None:
    """Write through a temp file in the same folder, then rename over `path`.

    os.replace within one filesystem is atomic, so a reader (or a process killed mid-write) sees the old
    file or the new one, never half of one. No fsync: this guards against a killed process, not power loss,
    and an fsync per frame would stall the stream on slow disks.

    The rename replaces whatever is at `path`, so what is there is looked at first (file_to_write): a
    symlink is written through (the temp file goes beside its target), and a FIFO or a device is refused
    rather than replaced by a regular file.
    """
    path = file_to_write(path)
    # Not tempfile.mkstemp: its 0600 mode would survive the rename. O_EXCL with 0666 lets the umask decide,
    # as for any other file the user creates; pid, thread and a counter keep concurrent writers apart.
    tmp_name = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.{next(_temp_counter)}.tmp"
    fd = os.open(tmp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


# A folder of files replaced as one (an export's folder; a run's predictions): the new files are written into a hidden folder
# beside the old ones (staging), and swapped in once complete, the old ones moved out (retired) and
# removed. Each hidden folder is named by the process that made it, so that the next writer there can
# tell a dead one's remains from a live one's work.
STAGING_PREFIX = ".stream-recon-new."
RETIRED_PREFIX = ".stream-recon-old."


def staging_folder(folder: Path) -> Path:
    """A new hidden folder inside `folder` for files that will replace some of its entries."""
    staging = Path(folder) / f"{STAGING_PREFIX}{os.getpid()}"
    staging.mkdir()
    return staging


def is_staging(entry: Path) -> bool:
    return entry.name.startswith((STAGING_PREFIX, RETIRED_PREFIX))


def swap_in_staged(staging: Path, earlier: list[Path]) -> None:
    """Move the `earlier` entries of staging's folder out and staging's entries in, then remove both
    hidden folders. A few renames on one filesystem: the caller holds signals across them, which leaves
    only a SIGKILL between two renames to mix the old entries with the new."""
    folder = staging.parent
    retired = folder / f"{RETIRED_PREFIX}{os.getpid()}"
    retired.mkdir()
    for entry in earlier:
        os.replace(entry, retired / entry.name)
    for entry in staging.iterdir():
        os.replace(entry, folder / entry.name)
    staging.rmdir()
    remove_tree(retired)


def remove_stale_staging(folder: Path) -> None:
    """Remove the hidden folders that a writer killed part-way (SIGKILL, a power cut) left in `folder`: those
    of a process that no longer runs. A live writer's are left to it."""
    for entry in Path(folder).iterdir():
        owner = entry.name.removeprefix(STAGING_PREFIX).removeprefix(RETIRED_PREFIX)
        if is_staging(entry) and owner.isdigit() and not _process_alive(int(owner)):
            remove_tree(entry)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def remove_tree(entry: Path) -> None:
    """A folder with everything in it, or a file or a link (never what a link points to)."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink(missing_ok=True)


# A path whose bytes are not UTF-8 (a folder named on another system) reaches Python with lone surrogates
# (os.fsdecode), which json writes as "\udcff": JSON that strict readers (serde, Go, jq --seq) refuse. Such a
# string is written readable, each byte that is not UTF-8 as \xNN, and exactly, its bytes in hex, under
# NOT_UTF8_KEY, by where it is ("settings/source_location"); read_run_info puts it back as it was.
NOT_UTF8_KEY = "not_utf8"


def write_json_atomic(path: Path, data: dict) -> None:
    text = json.dumps(utf8_record(data), indent=2) + "\n"
    atomic_write(path, lambda f: f.write(text), binary=False)


def utf8_record(data: dict) -> dict:
    """data as JSON types, every string strict UTF-8: one that is not written readable (\\xNN for each such
    byte) and exactly, in hex under NOT_UTF8_KEY (absent when there is none); exact_strings reads it back."""
    exact: dict[str, str] = {}
    readable = _utf8_only(json.loads(json.dumps(data, default=_json_default)), "", exact)
    if exact:
        readable[NOT_UTF8_KEY] = exact
    return readable


def _utf8_only(value: Any, where: str, exact: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {_utf8_key(key): _utf8_only(item, f"{where}/{key}".lstrip("/"), exact) for key, item in value.items()}
    if isinstance(value, list):
        return [_utf8_only(item, f"{where}/{index}", exact) for index, item in enumerate(value)]
    if isinstance(value, str) and not _is_utf8(value):
        exact[where] = os.fsencode(value).hex()
        return os.fsencode(value).decode("utf-8", "backslashreplace")
    return value


def _utf8_key(key: str) -> str:
    return key if _is_utf8(key) else os.fsencode(key).decode("utf-8", "backslashreplace")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def exact_strings(data: dict) -> dict:
    """data with each string NOT_UTF8_KEY holds put back (utf8_record)."""
    for where, hex_bytes in (data.pop(NOT_UTF8_KEY, None) or {}).items():
        *parents, last = where.split("/")
        holder: Any = data
        try:
            for part in parents:
                holder = holder[int(part)] if isinstance(holder, list) else holder[part]
            holder[int(last) if isinstance(holder, list) else last] = os.fsdecode(bytes.fromhex(hex_bytes))
        except (KeyError, IndexError, ValueError, TypeError):
            continue  # a record edited by hand: the readable string stays
    return data


def _json_default(value: Any) -> Any:
    # Settings carry Paths, numpy scalars and small arrays; everything else is written as its repr.
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return repr(value)


# --------------------------------------------------------------------------------------------------
# Does a folder hold a run? (checked before a model loads, and again by the writer)


def run_files(output_dir: Path) -> list[Path]:
    """The files of a run already in `output_dir`: what a new run there would replace."""
    output_dir = Path(output_dir)
    found = [path for path in (output_dir / name for name in (RUN_JSON, TRAJECTORY_TUM, TRAJECTORY_OPEN_TUM, POINTS_PLY))
             if path.exists()]
    predictions = output_dir / PREDICTIONS_DIR
    if predictions.is_dir():
        found += [path for path in predictions.iterdir() if _PREDICTION_NAME.match(path.name)]
    return found


def remove_run(output_dir: Path) -> None:
    """Delete what a run in `output_dir` wrote and what was derived from it (eval.json, exports/, a batch's
    marker), so that a replacing run leaves nothing of the old one beside its own files. Other files
    in the folder are the user's and stay. Raises OSError."""
    output_dir = Path(output_dir)
    for path in run_files(output_dir):
        path.unlink()
    for name in (EVAL_JSON, BATCH_MARKER):
        (output_dir / name).unlink(missing_ok=True)
    for folder in (EXPORTS_DIR, MAP_DIR):  # what was derived from the run, and its saved map
        path = output_dir / folder
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)


def replace_run(output_dir: Path) -> None:
    """Clear an earlier run out of `output_dir` for a new one (remove_run), its predictions first moved
    aside in one rename, so that a process killed part-way never leaves some of the earlier npz files
    under a new run.json; what was moved aside is removed then, or by the next run there (remove_stale_staging).
    Raises OSError."""
    output_dir = Path(output_dir)
    remove_stale_staging(output_dir)
    predictions = output_dir / PREDICTIONS_DIR
    if predictions.is_dir() and not predictions.is_symlink():
        retired = output_dir / f"{RETIRED_PREFIX}{os.getpid()}"
        os.replace(predictions, retired)
        predictions.mkdir()
        remove_tree(retired)
    remove_run(output_dir)


def holds_run(output_dir: Path) -> bool:
    return bool(run_files(output_dir))


# What a run directory holds besides the run's own files (run_files): a folder holding only these (or
# hidden files) is not someone else's folder.
_RUN_DIR_NAMES = {PREDICTIONS_DIR, RUN_JSON, TRAJECTORY_TUM, TRAJECTORY_OPEN_TUM, POINTS_PLY, EVAL_JSON, EXPORTS_DIR,
                  BATCH_MARKER, MAP_DIR}


def foreign_entries(output_dir: Path) -> list[Path]:
    """What a folder holds that no run wrote (hidden files aside): a run there would mix its files in."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    return sorted(entry for entry in output_dir.iterdir()
                  if entry.name not in _RUN_DIR_NAMES and not entry.name.startswith("."))


def prepare_output_dir(output_dir: Path, *, overwrite: bool) -> Path | None:
    """Make sure `output_dir` can take a run, and hold it for this process (lock_run_dir). Returns the
    outermost folder created here (`output_dir` or a parent of it; None when it existed), for
    remove_if_empty.

    Refuses a folder another process's run holds, whatever it holds now; a folder that holds a run unless
    `overwrite`, and a folder that holds no run but other files whatever `overwrite` says (a run would mix
    its files in with them; files a user put beside a run stay when it is replaced); the run's old files
    are left for the writer to remove, so that a run that never starts destroys nothing.
    """
    output_dir = Path(output_dir)
    held_before = run_dir_locked_here(output_dir)
    try:
        if output_dir.is_dir():  # first: a folder another run writes is refused before anything is looked at
            lock_run_dir(output_dir)
        created = _check_and_make_output_dir(output_dir, overwrite)
        lock_run_dir(output_dir)  # (a folder made here, or by another run that started at the same instant)
    except BaseException:
        if not held_before:
            unlock_run_dir(output_dir)
        raise
    return created


def _check_and_make_output_dir(output_dir: Path, overwrite: bool) -> Path | None:
    link = dangling_link(output_dir)
    if link is not None:
        where = f"output path {output_dir}" + ("" if link == output_dir else f": {link}")
        raise OutputDirError(
            f"{where} is a symbolic link to {os.readlink(link)}, which does not exist; create the folder it points "
            "to, or choose another --output"
        )
    if output_dir.exists() and not output_dir.is_dir():
        raise OutputDirError(f"output path {output_dir} exists and is not a directory; choose another --output")
    previous = run_files(output_dir)
    if previous and not overwrite:
        raise OutputDirError(
            f"output directory {output_dir} already holds a run ({len(previous)} files such as "
            f"{previous[0].name}); choose another --output or pass --overwrite to replace it"
        )
    foreign = [] if previous else foreign_entries(output_dir)
    if foreign:
        raise OutputDirError(
            f"output directory {output_dir} is not empty and holds no run ({len(foreign)} entries such as "
            f"{foreign[0].name}): a run would mix its files in with them; choose a new or empty --output"
        )
    created = outermost_missing(output_dir)
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except BaseException as error:  # a Ctrl-C or SIGTERM in here too: what was made goes
        with interrupts_held():  # (the CLI redelivers an unanswered signal every 0.5 s)
            remove_if_empty(output_dir, created)
        if isinstance(error, OSError):
            raise OutputDirError(
                f"cannot write to the output directory {output_dir}: {error.strerror or error}; "
                "choose a writable --output"
            ) from None
        raise
    return created


# One run per folder: a run holds an exclusive flock on its folder from its check to its end. The kernel lets
# go when the process ends, however it ends (kill -9 too), and nothing is written into the folder for it.
_held_run_dirs: dict[Path, int] = {}  # the folder, resolved -> the descriptor that holds its lock
_held_run_dirs_guard = threading.Lock()


def lock_run_dir(output_dir: Path) -> None:
    """Hold `output_dir` for this process's run; nothing to do when this process holds it already. Raises
    OutputDirError when another process holds it."""
    key = Path(output_dir).resolve()
    with _held_run_dirs_guard:
        if key in _held_run_dirs:
            return
        descriptor = os.open(key, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(descriptor)
            raise OutputDirError(
                f"output directory {output_dir} is in use by another stream-recon run; "
                "wait for it to end, or choose another --output"
            ) from None
        _held_run_dirs[key] = descriptor


def unlock_run_dir(output_dir: Path) -> None:
    """Let `output_dir` go (nothing to do when this process does not hold it)."""
    with _held_run_dirs_guard:
        descriptor = _held_run_dirs.pop(Path(output_dir).resolve(), None)
    if descriptor is not None:
        os.close(descriptor)  # (closing the descriptor releases its lock)


def run_dir_locked_here(output_dir: Path) -> bool:
    return Path(output_dir).resolve() in _held_run_dirs


def run_dir_in_use(run_dir: Path) -> bool:
    """Whether a live process's run holds `run_dir` (this process's own included)."""
    try:
        descriptor = os.open(Path(run_dir), os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(descriptor)
    return False


def dangling_link(path: Path) -> Path | None:
    """`path` or the nearest of its parents that is a symbolic link to nothing, or None: a folder cannot be
    made there (mkdir says only "File exists")."""
    for folder in (path, *path.parents):
        if folder.exists():
            return None
        if folder.is_symlink():
            return folder
    return None


def outermost_missing(path: Path) -> Path | None:
    missing = None
    for folder in (path, *path.parents):
        if folder.exists() or folder.is_symlink():
            break
        missing = folder
    return missing


def remove_if_empty(output_dir: Path, created: Path | None) -> None:
    """Remove the folders a run created (`created`: the outermost, from prepare_output_dir) that it left
    empty: a run that never started leaves nothing behind, not even an empty outputs/."""
    if created is None:
        return
    output_dir = Path(output_dir)
    folders = [output_dir / PREDICTIONS_DIR, output_dir]
    folders += [parent for parent in output_dir.parents if parent == created or created in parent.parents]
    for folder in folders:
        with contextlib.suppress(OSError):
            if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
                folder.rmdir()


# --------------------------------------------------------------------------------------------------
# Reading a run back


def check_run_dir(run_dir: Path) -> Path:
    """Raise RunDirError unless `run_dir` looks like a run directory; returns its predictions folder."""
    run_dir = Path(run_dir)
    predictions = run_dir / PREDICTIONS_DIR
    if not run_dir.exists():
        raise RunDirError(f"run directory {run_dir} does not exist")
    if not run_dir.is_dir():
        raise RunDirError(
            f"{run_dir} is a file, not a run directory: give the folder a run wrote (it holds {PREDICTIONS_DIR}/)"
        )
    if not predictions.is_dir():
        raise RunDirError(f"{run_dir} is not a run directory: it has no {PREDICTIONS_DIR}/ folder")
    return predictions


def prediction_files(run_dir: Path) -> list[tuple[int, Path]]:
    """(frame index, path) of every prediction file of a run, in frame order."""
    predictions = check_run_dir(run_dir)
    found = []
    for path in predictions.iterdir():
        match = _PREDICTION_NAME.match(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def load_prediction(path: Path) -> dict[str, Any]:
    """One npz as a dict: scalars as Python values, arrays as numpy; `image` is None when absent.
    Depth and confidence come back as float32 however they were stored (PredictionOutputs).

    Raises ValueError (or OSError) when the file is truncated, not an npz, or lacks a key.
    """
    with opened_npz(path) as data:
        record: dict[str, Any] = {RENAMED_FIELDS.get(key, key): data[key] for key in data.files}
        missing = [key for key in PREDICTION_FIELDS if key not in record]
        if missing:
            raise ValueError(f"{path.name} lacks {', '.join(missing)}")
    check_fields(path, record)
    for key, field in PREDICTION_FIELDS.items():
        if field.is_scalar:
            record[key] = record[key].item()
    for key in HALVABLE_FIELDS:
        record[key] = record[key].astype(PREDICTION_FIELDS[key].dtype, copy=False)
    record.setdefault("image", None)
    record["sky_mask"] = record["sky_mask"].astype(bool) if "sky_mask" in record else None
    return record


def prediction_fields(path: Path, *names: str) -> dict[str, Any]:
    """Some fields of one npz, read alone (the others, depth and image say, stay on disk): scalars as Python
    values, arrays as numpy, depth and confidence as float32. Raises ValueError (or OSError) as
    load_prediction does."""
    stored_names = {RENAMED_FIELDS.get(key, key): key for key in RENAMED_FIELDS} | {name: name for name in names}
    with opened_npz(path) as data:  # members are read lazily
        present = {name: stored for name, stored in stored_names.items() if stored in data.files}
        missing = [name for name in names if name not in present]
        if missing:
            raise ValueError(f"{path.name} lacks {', '.join(missing)}")
        record: dict[str, Any] = {name: data[present[name]] for name in names}
    check_fields(path, record)
    for name in names:
        field = PREDICTION_FIELDS.get(name)
        if field is not None and field.is_scalar:
            record[name] = record[name].item()
        elif name in HALVABLE_FIELDS:
            record[name] = record[name].astype(field.dtype, copy=False)
    return record


# Every array a prediction file may hold, by name
_FIELDS = {**PREDICTION_FIELDS, "image": IMAGE_FIELD, "sky_mask": SKY_MASK_FIELD}


def check_fields(path: Path, record: dict[str, Any]) -> None:
    """The arrays of a prediction file (`record`, as read: some or all of its fields) of the schema's kinds and
    shapes, those of the model input's size ("H", "W") of the file's own image_size where it was read:
    ValueError naming the file and what is wrong, so that a damaged or foreign file is skipped by its name
    rather than failing an export in numpy's words."""
    size = record.get("image_size")
    if size is not None and (np.shape(size) != (2,) or size.dtype.kind not in "iu" or min(size) < 1):
        raise ValueError(f"{path.name} is damaged: its image_size is {_shown(size)}, not a height and a width")
    sizes = {} if size is None else {"H": int(size[0]), "W": int(size[1])}
    for name, value in record.items():
        field = _FIELDS.get(name)
        if field is None:
            continue
        if value.dtype.kind not in "biuf":
            raise ValueError(f"{path.name} is damaged: its {name} holds {value.dtype} values, not numbers")
        if any(axis in ("H", "W") for axis in field.shape) and not sizes:
            continue  # (a few fields read alone, without image_size)
        expected = tuple(sizes.get(axis, axis) for axis in field.shape)
        if value.shape != expected:
            said = f" (its image_size is {sizes['H']}x{sizes['W']})" if expected != field.shape else ""
            raise ValueError(f"{path.name} is damaged: its {name} has the shape {_shown_shape(value.shape)}, not "
                             f"{_shown_shape(expected)}{said}")


def _shown_shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(size) for size in shape) if shape else "of a single value"


def _shown(value: Any) -> str:
    text = np.array2string(np.asarray(value), threshold=6)
    return text if len(text) < 60 else text[:57] + "..."


# numpy parses each array's header with ast.literal_eval, and CPython 3.11 counts the depth of an AST's
# conversion per interpreter, not per thread: two threads converting at once can fail with
# SystemError("AST constructor recursion depth mismatch"). Threads reading npz files take turns.
_NPZ_READ_LOCK = threading.Lock()


def stored_prediction(path: Path) -> dict[str, np.ndarray]:
    """Every array of one npz as stored (its keys and dtypes unchanged), for rewriting the file; safe to call
    from several threads (they read one at a time, the reads being short beside the writes)."""
    with _NPZ_READ_LOCK, opened_npz(path) as data:
        return {key: data[key] for key in data.files}


# An npz is a zip archive, which starts with a local file header (an empty one, with its end record).
_ZIP_STARTS = (b"PK\x03\x04", b"PK\x05\x06")


@contextlib.contextmanager
def opened_npz(path: Path) -> Iterator[Any]:
    """np.load of one npz, every way a file fails to be one raised as ValueError in the project's words.

    A file that is not a zip archive is refused before numpy reads it: numpy takes it for a pickle and its
    error advises loading it with allow_pickle, which would run whatever code a damaged or planted file
    holds. Raises OSError when the file cannot be read at all.
    """
    path = Path(path)
    with open(path, "rb") as file:
        start = file.read(4)
    if not start:
        raise ValueError(f"{path.name} is empty, not an npz file")
    if start not in _ZIP_STARTS:
        raise ValueError(f"{path.name} is not an npz file (it does not start as a zip archive does)")
    try:
        with np.load(path, allow_pickle=False) as data:
            yield data
    except (zipfile.BadZipFile, EOFError) as exc:
        raise ValueError(f"{path.name} is truncated or not an npz file ({exc})") from None
    except ValueError as exc:
        if "allow_pickle" not in str(exc):  # numpy's refusal of a member that holds Python objects (a pickle)
            raise
        raise ValueError(f"{path.name} holds an array of Python objects, which is never loaded (loading one runs "
                         "the code it holds): it is no prediction file of a run") from None


def iter_run(run_dir: Path, frames: Collection[int] | None = None) -> Iterator[dict[str, Any]]:
    """Yield the predictions of a run in frame order, one npz in memory at a time; `frames`: only these frame
    indices (a second pass over frames read before: a file skipped then is not read, nor warned of, again).

    A file that cannot be read (typically the last one of a run killed by the OS mid-write on a filesystem
    without atomic rename, or one damaged afterwards: arrays of another shape, of Python objects) is skipped
    with a warning naming it instead of failing the whole run.
    """
    for frame_index, path in prediction_files(run_dir):
        if frames is not None and frame_index not in frames:
            continue
        try:
            record = load_prediction(path)
        except FileNotFoundError:
            logger.warning("skipping frame %d: %s disappeared while reading", frame_index, path)
            continue
        except (OSError, ValueError) as exc:
            logger.warning("skipping frame %d: cannot read %s: %s", frame_index, path, exc)
            continue
        yield record


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


def loop_closure_summary(run_info: Any) -> dict[str, Any]:
    """run.json's `summary.loop_closure` (read_run_info's record): what loop closure did in the run; {} for
    a run without it (loop closure off, or a run written before it existed)."""
    summary = run_info.get("summary") if isinstance(run_info, dict) else None
    closure = summary.get("loop_closure") if isinstance(summary, dict) else None
    return closure if isinstance(closure, dict) else {}


def run_accepted_loops(run_dir: Path) -> int | None:
    """How many loops the run's pose graph used (run.json's summary.loop_closure.accepted); None when
    run.json does not say (a run without loop closure, or one written before it existed)."""
    accepted = loop_closure_summary(read_run_info(run_dir)).get("accepted")
    return accepted if isinstance(accepted, int) and not isinstance(accepted, bool) else None


def read_run_info(run_dir: Path) -> dict[str, Any]:
    """run.json as a dict, or {} when it is missing or unreadable (the predictions are still usable)."""
    path = Path(run_dir) / RUN_JSON
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return exact_strings(data) if isinstance(data, dict) else data
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring %s: %s", path, exc)
        return {}


def read_batch_marker(run_dir: Path) -> dict | None:
    """The batch's marker of a finished sequence (BATCH_MARKER) as a dict; None when it is missing or
    unreadable."""
    try:
        marker = json.loads((Path(run_dir) / BATCH_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def write_batch_marker(run_dir: Path, marker: dict) -> None:
    """Mark a run directory finished for `batch`, atomically: the marker is there whole or not at all."""
    write_json_atomic(Path(run_dir) / BATCH_MARKER, marker)


# --------------------------------------------------------------------------------------------------
# TUM text files


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

