"""Which sequences a batch skips and which it redoes: a finished sequence's row and the settings it ran with
(its marker, `.complete`), compared with the batch's in the settings that change results, a checkpoint named
by another path to the same file being no change.

Its own module because resuming is a rule of its own (the batch's docstring says why a change is refused
rather than redone silently), decided before any model loads.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from stream_recon.app.options import RunOptions, changed_settings
from stream_recon.app.outputs.rundir import read_batch_marker, read_run_info
from stream_recon.app.run.loading import CheckpointDigest
from stream_recon.models import DEFAULT_CHECKPOINT


def finished_row(run_dir: Path) -> dict | None:
    """The row a finished sequence left in its marker, or None when it has not finished."""
    marker = read_batch_marker(run_dir)
    return None if marker is None else {key: value for key, value in marker.items() if key != "settings"}


def finished_settings(run_dir: Path) -> dict:
    """The result settings a finished sequence ran with: its marker's, or (markers written before they
    held them) the options recorded in its run.json."""
    marker = read_batch_marker(run_dir) or {}
    if isinstance(marker.get("settings"), dict):
        return marker["settings"]
    run_info = read_run_info(run_dir)
    settings = run_info.get("settings") if isinstance(run_info, dict) else None
    return settings if isinstance(settings, dict) else {}


class SameCheckpoint:
    """Whether a finished run used the checkpoint file this batch names, however the path is spelled
    (absolute here, relative there): the sha256 its run.json recorded against this file's (hashed once)."""

    def __init__(self, checkpoint: str | None) -> None:
        self._checkpoint = checkpoint
        self._digest: str | None = None
        self._hashed = False

    def __call__(self, run_dir: Path) -> bool:
        run_info = read_run_info(run_dir)
        summary = run_info.get("summary") if isinstance(run_info, dict) else None
        recorded = summary.get("checkpoint_digest") if isinstance(summary, dict) else None
        return recorded is not None and recorded == self._digest_now()

    def _digest_now(self) -> str | None:
        if not self._hashed:
            self._hashed = True
            self._digest = CheckpointDigest(self._checkpoint or DEFAULT_CHECKPOINT).result()
        return self._digest


def result_changes(run_dir: Path, run_options: RunOptions, same_checkpoint: Callable[[Path], bool]) -> list[str]:
    """What a finished sequence ran with otherwise than these options, in the settings that change results
    (`name old -> new`); a checkpoint named by another path to the same file is no change."""
    before = finished_settings(run_dir)
    changes = changed_settings(before, run_options.result_settings())
    if any(change.startswith("checkpoint ") for change in changes) and same_checkpoint(run_dir):
        changes = [change for change in changes if not change.startswith("checkpoint ")]
    return changes


def outdated_message(output_dir: Path, outdated: dict[str, list[str]], total: int) -> str:
    names = list(outdated)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"{len(names)} of {total} sequences in {output_dir} were finished with other settings "
        f"({shown}: {', '.join(outdated[names[0]])}); pass --overwrite to redo them with these settings, "
        "or choose another --output"
    )
