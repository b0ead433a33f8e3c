"""How every file a run, an export, an evaluation or a batch writes reaches the disk: `atomic_write` (a temp
file beside it, then a rename over it), and a folder's entries replaced as one (`staging_folder`, then
`move_in_staged` and the earlier entries removed: `remove_retired`, `remove_detached`).

Its own module because it knows nothing of what a run directory holds: every writer of app/ calls it, and
it is the one place that renames over a user's file (tests/test_architecture_rules.py holds the rest to it).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from itertools import count
from pathlib import Path
from typing import Any

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


def move_in_staged(staging: Path, earlier: list[Path]) -> Path:
    """Move the `earlier` entries of staging's folder out into a hidden folder (returned: the caller removes
    it, remove_retired) and staging's entries in, then remove staging. A few renames on one filesystem: the
    caller holds signals across them, which leaves only a SIGKILL between two renames to mix the old entries
    with the new."""
    folder = staging.parent
    retired = folder / f"{RETIRED_PREFIX}{os.getpid()}"
    retired.mkdir()
    for entry in earlier:
        os.replace(entry, retired / entry.name)
    for entry in staging.iterdir():
        os.replace(entry, folder / entry.name)
    staging.rmdir()
    return retired


# A retired folder's removal can take seconds (the earlier predictions of a 10,000-frame run, 14 GB: 11.3 s on a
# 16-core GPU host), past the 10 s a stopped command has: a writer stopped part-way through it, or one that does
# not wait for it (a refine), leaves it to a process of its own session, which the stop's signal and the
# writer's exit leave running. It tries again for up to 5 s while the folder is still there: a stopped writer's
# workers, killed as it ends, may add a file after a pass. Where it dies too, the folder is a dead writer's and
# the next writer there removes it (remove_stale_staging).
_REMOVER = """
import os, shutil, sys, time
for _ in range(50):
    shutil.rmtree(sys.argv[1], ignore_errors=True)
    if not os.path.lexists(sys.argv[1]):
        break
    time.sleep(0.1)
"""


def remove_detached(folder: Path) -> None:
    """Start removing `folder` in a detached process (above) and return at once; where no process can be
    started (OSError: no interpreter there, no room for a process), remove it here."""
    try:
        subprocess.Popen([sys.executable, "-I", "-S", "-c", _REMOVER, str(folder)], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        remove_tree(folder)


def remove_retired(retired: Path) -> None:
    """Remove a folder of replaced entries. Interruptible: a stop (KeyboardInterrupt, SystemExit) or an error
    part-way hands what is left to remove_detached and is raised again, so that the stopped command exits at
    once; the entries that replaced them are in place already."""
    try:
        remove_tree(retired)
    except BaseException:
        remove_detached(retired)
        raise


def remove_stale_staging(folder: Path) -> None:
    """Remove the hidden folders that a writer killed part-way (SIGKILL, a power cut) left in `folder`: those
    of a process that no longer runs. A live writer's are left to it; a stopped writer's remover (remove_detached)
    may be removing the same folder meanwhile."""
    for entry in Path(folder).iterdir():
        owner = entry.name.removeprefix(STAGING_PREFIX).removeprefix(RETIRED_PREFIX)
        if is_staging(entry) and owner.isdigit() and not _process_alive(int(owner)):
            _remove_stale(entry)


def _remove_stale(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():  # what a remover took meanwhile is no error; what stays is
        shutil.rmtree(entry, ignore_errors=True)
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
