"""Convert an official `.pt` checkpoint to `.safetensors` with the model configuration in its metadata.

A safetensors file loads without pickle, memory-maps, and carries its own config, so runs need no
preset to know the architecture.

Examples:

    stream-recon convert lingbot-map-long.pt lingbot-map-long.safetensors
    stream-recon clip.mp4 --checkpoint lingbot-map-long.safetensors
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from stream_recon.app.commands._options import bad_input, error_console, stop_said, user_errors
from stream_recon.models.errors import CheckpointError, checkpoint_advice


def convert(
    source: Annotated[Path, typer.Argument(help="Official checkpoint (.pt).", show_default=False)],
    destination: Annotated[Path, typer.Argument(help="File to write (.safetensors).", show_default=False)],
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace DESTINATION if it exists.")] = False,
) -> None:
    """Convert a .pt checkpoint to .safetensors (keys checked strictly on the way)."""
    console = error_console()
    problem = _check_paths(source, destination, overwrite)
    if problem:
        bad_input(console, problem)
    # the checkpoint's modules load torch: only once there is work, never for -h
    from stream_recon.models.checkpoint import convert_to_safetensors  # torch: only once there is work

    kept = f"; the earlier {destination} is as it was" if destination.exists() else ""
    with user_errors(console), stop_said(console, f"nothing was written to {destination}{kept}"), \
            console.status(f"converting {source}"):
        try:
            written = convert_to_safetensors(source, destination)
        except CheckpointError as error:
            raise CheckpointError(checkpoint_advice(str(error))) from None
    console.print(f"[green]wrote[/green] {written or destination}")


def _check_paths(source: Path, destination: Path, overwrite: bool) -> str | None:
    if not source.is_file():
        return f"checkpoint not found: {source}"
    if destination.suffix != ".safetensors":
        return f"the destination must end in .safetensors, got {destination.name}"
    if destination.resolve() == source.resolve():
        return "the destination is the source file; choose another name"
    if destination.exists() and not overwrite:
        return f"{destination} already exists; pass --overwrite to replace it"
    if not destination.parent.is_dir():
        return f"folder {destination.parent} does not exist; create it first"
    return None
