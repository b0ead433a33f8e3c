"""Reading one prediction npz: never as a pickle, every way a file fails to be one said in the project's
words, its arrays checked against the npz schema (kinds and shapes), depth and confidence as float32.

Its own module because it reads one file whatever folder it lies in (a run's, a refine's staging); which
files a run has and in which order is rundir.py's.
"""

from __future__ import annotations

import contextlib
import threading
import zipfile
from collections.abc import Iterator
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


def load_prediction(path: Path) -> dict[str, Any]:
    """One npz as a dict: scalars as Python values, arrays as numpy; `image` is None when absent.
    Depth and confidence come back as float32 however they were stored (PredictionOutputs).

    Raises ValueError (or OSError) when the file is truncated, not an npz, or lacks a key.
    """
    with opened_npz(path) as data:
        stored = {key: data[key] for key in data.files}
    return prediction_record(path, stored)


def prediction_record(path: Path, stored: dict[str, np.ndarray]) -> dict[str, Any]:
    """load_prediction's dict from the arrays of one npz as stored (`path` names the file in errors): for a
    writer that has them in hand and need not read its file back."""
    record: dict[str, Any] = {RENAMED_FIELDS.get(key, key): value for key, value in stored.items()}
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


def mapped_array(path: Path) -> np.ndarray:
    """The array of one .npy file, mapped read-only: processes that map one file share its pages."""
    return np.load(path, mmap_mode="r", allow_pickle=False)


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
