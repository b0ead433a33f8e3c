"""Download an official checkpoint into the Hugging Face cache, where `--checkpoint NAME` finds it, or the
sky network `--mask-sky` runs (skyseg).

Examples:

    stream-recon download                      # lingbot-map-long, the default checkpoint
    stream-recon download lingbot-map
    stream-recon download skyseg               # skyseg.onnx, for --mask-sky
    HF_HOME=/data/hf stream-recon download     # another cache location (set it for runs too)

Without the hub (offline mode, or no network) it fails at once, naming the file's URL to fetch on
another machine and the folder to put it in here.

Exit codes: 0 downloaded; 2 an unknown name, or the hub cannot be reached (offline mode, no network: as a
run that needs the file exits); 1 the download failed after the hub answered (refused, cut off, a full disk);
130 Ctrl-C; 143 SIGTERM.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from stream_recon.app.commands._options import EXIT_FAILED, bad_input, error_console, error_line
from stream_recon.models import CheckpointError, CheckpointUnavailable

DEFAULT_NAME = "lingbot-map-long"
SKYSEG_NAME = "skyseg"  # the sky network of --mask-sky (app.outputs.sky), not a checkpoint


def download(
    name: Annotated[
        str, typer.Argument(help="Checkpoint name: lingbot-map-long or lingbot-map; or skyseg, the sky network "
                            "of --mask-sky.")
    ] = DEFAULT_NAME,
) -> None:
    """Fetch a checkpoint from Hugging Face (robbyant/lingbot-map) into the local cache."""
    console = error_console()
    if name == SKYSEG_NAME:
        _download_skyseg(console)
        return
    # huggingface_hub: when the command downloads a checkpoint, never for -h or the sky network
    from stream_recon.models.hub_paths import CHECKPOINT_SIZE, KNOWN_CHECKPOINTS, download_checkpoint

    if name not in KNOWN_CHECKPOINTS:
        bad_input(console, f"unknown checkpoint {name!r}; known: {', '.join(KNOWN_CHECKPOINTS)}, or {SKYSEG_NAME}")

    try:  # huggingface_hub draws its own progress bar; offline or unreachable, the error alone says what to do
        path = download_checkpoint(
            name, on_start=lambda: console.print(f"downloading {name} from Hugging Face (about {CHECKPOINT_SIZE})"))
    except CheckpointUnavailable as error:  # no hub to ask: exit 2, as a run that needs the file
        bad_input(console, str(error))
    except (CheckpointError, OSError) as error:  # the network or the disk failed, not what was typed
        reason = str(error) if isinstance(error, CheckpointError) else f"writing it failed: {error.strerror or error}"
        console.print(f"[red]error:[/red] {escape(error_line(reason))}")
        raise typer.Exit(code=EXIT_FAILED) from None
    console.print(f"[green]downloaded[/green] {name}: {path}")


def _download_skyseg(console) -> None:
    """Fetch skyseg.onnx into the Hugging Face cache; offline or unreachable, one line at once naming its URL and
    the folder to put it in (exit codes as a checkpoint's)."""
    # the sky module loads OpenCV: when the command runs, never for -h
    from stream_recon.app.outputs.sky import (
        SKYSEG_FILE,
        SkyModelError,
        SkyNetworkUnavailable,
        download_skyseg,
        locate_skyseg,
    )

    found = locate_skyseg()
    if found is not None:
        console.print(f"[green]already here[/green] {SKYSEG_FILE}: {found}")
        return
    try:
        path = download_skyseg()
    except SkyNetworkUnavailable as error:  # no hub to ask: exit 2, as a run with --mask-sky
        bad_input(console, str(error))
    except SkyModelError as error:
        console.print(f"[red]error:[/red] {escape(error_line(str(error)))}")
        raise typer.Exit(code=EXIT_FAILED) from None
    console.print(f"[green]downloaded[/green] {SKYSEG_FILE}: {path}")
