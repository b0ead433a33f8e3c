"""A run's output folder before and while the run writes it: checked (`prepare_output_dir`: not another's
folder, not another run's unless replaced), made, held by one run at a time (the folder lock), and removed
again when the run made it and left it empty.

Its own module because it is the run's claim on a folder, decided before a model loads; what a run
directory holds and how it is read back is rundir.py's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import threading
from pathlib import Path

from stream_recon.app.outputs.rundir import PREDICTIONS_DIR, foreign_entries, run_files
from stream_recon.app.stopping import interrupts_held


class OutputDirError(ValueError):
    """The output directory cannot be created, written, or already holds another run."""


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
