"""Download an official checkpoint into the Hugging Face cache, where `--checkpoint NAME` finds it, or the
sky network `--mask-sky` runs (skyseg).

Examples:

    stream-recon download                      # lingbot-map-long, the default checkpoint
    stream-recon download lingbot-map
    stream-recon download skyseg               # skyseg.onnx, for --mask-sky
    HF_HOME=/data/hf stream-recon download     # another cache location (set it for runs too)

Without the hub (offline mode, or no network) it fails at once, naming the file's URL to fetch on
another machine and the folder to put it in here.

Exit codes: 0 downloaded; 1 the download failed (no network, the hub offline, a full disk); 2 an unknown
name; 130 Ctrl-C; 143 SIGTERM.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from stream_recon.app.commands._options import EXIT_FAILED, bad_input, error_console, error_line
from stream_recon.models import CheckpointError

DEFAULT_NAME = "lingbot-map-long"
SKYSEG_NAME = "skyseg"  # the sky network of --mask-sky (app.outputs.sky), not a checkpoint


def download(
    name: Annotated[
        str, typer.Argument(help="Checkpoint name: lingbot-map-long or lingbot-map; or skyseg, the sky network "
                            "of --mask-sky.")
    ] = DEFAULT_NAME,
) -> None:
    """Fetch a checkpoint from Hugging Face (robbyant/lingbot-map) into the local cache."""
    # the checkpoint module loads torch: when the command runs, never for -h
    from stream_recon.models.checkpoint import (
        CHECKPOINT_SIZE,
        KNOWN_CHECKPOINTS,
        download_checkpoint,
        hub_offline,
    )

    console = error_console()
    if name == SKYSEG_NAME:
        _download_skyseg(console)
        return
    if name not in KNOWN_CHECKPOINTS:
        bad_input(console, f"unknown checkpoint {name!r}; known: {', '.join(KNOWN_CHECKPOINTS)}, or {SKYSEG_NAME}")
    if not hub_offline():  # offline, the error alone says what to do instead
        console.print(f"downloading {name} from Hugging Face (about {CHECKPOINT_SIZE})")

    try:  # huggingface_hub draws its own progress bar
        path = download_checkpoint(name)
    except (CheckpointError, OSError) as error:  # the network or the disk failed, not what was typed
        reason = str(error) if isinstance(error, CheckpointError) else f"writing it failed: {error.strerror or error}"
        console.print(f"[red]error:[/red] {escape(error_line(reason))}")
        raise typer.Exit(code=EXIT_FAILED) from None
    console.print(f"[green]downloaded[/green] {name}: {path}")


def _download_skyseg(console) -> None:
    """Fetch skyseg.onnx into the Hugging Face cache; offline or unreachable, one line naming its URL and the
    folder to put it in (exit 1, as a checkpoint's failed download)."""
    # the sky module loads OpenCV: when the command runs, never for -h
    from stream_recon.app.outputs.sky import SKYSEG_FILE, SkyModelError, download_skyseg, locate_skyseg

    found = locate_skyseg()
    if found is not None:
        console.print(f"[green]already here[/green] {SKYSEG_FILE}: {found}")
        return
    try:
        path = download_skyseg()
    except SkyModelError as error:
        console.print(f"[red]error:[/red] {escape(error_line(str(error)))}")
        raise typer.Exit(code=EXIT_FAILED) from None
    console.print(f"[green]downloaded[/green] {SKYSEG_FILE}: {path}")
