"""Download an official checkpoint into the Hugging Face cache, where `--checkpoint NAME` finds it.

Examples:

    stream-recon download                      # lingbot-map-long, the default checkpoint
    stream-recon download lingbot-map
    HF_HOME=/data/hf stream-recon download     # another cache location (set it for runs too)

Without the hub (offline mode, or no network) it fails at once, naming the file's URL to fetch on
another machine and the folder to put it in here.
"""

from __future__ import annotations

from typing import Annotated

import typer

from stream_recon.app.commands._options import bad_input, error_console, user_errors

DEFAULT_NAME = "lingbot-map-long"


def download(
    name: Annotated[
        str, typer.Argument(help="Checkpoint name: lingbot-map-long or lingbot-map.")
    ] = DEFAULT_NAME,
) -> None:
    """Fetch a checkpoint from Hugging Face (robbyant/lingbot-map) into the local cache."""
    from stream_recon.models.checkpoint import KNOWN_CHECKPOINTS, download_checkpoint, hub_offline

    console = error_console()
    if name not in KNOWN_CHECKPOINTS:
        bad_input(console, f"unknown checkpoint {name!r}; known: {', '.join(KNOWN_CHECKPOINTS)}")
    if not hub_offline():  # offline, the error alone says what to do instead
        console.print(f"downloading {name} from Hugging Face (about 4.6 GB)")
    with user_errors(console):  # huggingface_hub draws its own progress bar
        path = download_checkpoint(name)
    console.print(f"[green]downloaded[/green] {name}: {path}")
