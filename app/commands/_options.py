"""Options shared by `run`, `batch` and `view`, declared once, and the error boundary of every command.

Every run option defaults to None, meaning "not given": the value then comes from the preset
(`--config`) or RunOptions' default, so that a preset never silently beats a flag the user typed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

_MODEL = "Model"
_ENGINE = "Streaming engine"
_SOURCE = "Source"
_OUTPUT = "Outputs"
_VIEWER = "Live viewer"

# exit codes: bad input or options (nothing ran), a run that failed part-way, an interrupted run
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130

ConfigOpt = Annotated[
    Optional[str],
    typer.Option(
        "--config",
        help="Run preset: a name from configs/ (indoor, outdoor, low-memory) or a YAML file. Flags override it.",
        show_default=False,
    ),
]
CheckpointOpt = Annotated[
    Optional[str],
    typer.Option(
        "--checkpoint",
        "-c",
        help="Checkpoint path (.pt or .safetensors) or name (lingbot-map-long, lingbot-map). "
        "\\[default: lingbot-map-long]",
        rich_help_panel=_MODEL,
        show_default=False,
    ),
]
DeviceOpt = Annotated[
    Optional[str],
    typer.Option("--device", help="auto, cpu, cuda or cuda:N. \\[default: auto]", rich_help_panel=_MODEL,
                 show_default=False),
]
DtypeOpt = Annotated[
    Optional[str],
    typer.Option(
        "--dtype",
        help="Transformer precision: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16. \\[default: auto]",
        rich_help_panel=_MODEL,
        show_default=False,
    ),
]
AttentionOpt = Annotated[
    Optional[str],
    typer.Option(
        "--attention",
        help="Attention backend: auto (CUDA: dense-triton on Hopper, else dense-flashinfer if installed, else "
        "dense; CPU: sdpa), dense, dense-triton, dense-cudnn, dense-flashinfer (contiguous cache), sdpa, "
        "flashinfer (= flashinfer-fa2), flashinfer-fa3 (paged cache). \\[default: auto]",
        rich_help_panel=_MODEL,
        show_default=False,
    ),
]
CompileOpt = Annotated[
    Optional[bool],
    typer.Option(
        "--compile/--no-compile",
        help="Fuse the transformer blocks with torch.compile (CUDA only): about 20% faster per frame; the first "
        "run on a machine compiles for a minute or two, later runs read the cache. \\[default: compile]",
        rich_help_panel=_MODEL,
        show_default=False,
    ),
]
ScaleFramesOpt = Annotated[
    Optional[int],
    typer.Option("--scale-frames", help="Frames processed together at the start and kept forever. \\[default: 8]",
                 rich_help_panel=_ENGINE, show_default=False),
]
WindowOpt = Annotated[
    Optional[int],
    typer.Option("--window", help="Sliding window of recent frames whose patch tokens stay visible. \\[default: 64]",
                 rich_help_panel=_ENGINE, show_default=False),
]
WindowFramesOpt = Annotated[
    Optional[int],
    typer.Option("--window-frames", help="Long streams: cached frames per window before a new window starts, "
                 "aligned on the overlap. \\[default: 320, the trained range]", rich_help_panel=_ENGINE,
                 show_default=False),
]
OverlapOpt = Annotated[
    Optional[int],
    typer.Option("--overlap", help="Long streams: frames two consecutive windows share. \\[default: 16]",
                 rich_help_panel=_ENGINE, show_default=False),
]
KeyframesOpt = Annotated[
    Optional[str],
    typer.Option("--keyframes", help="Keyframe policy: all, interval:N or flow. \\[default: all]",
                 rich_help_panel=_ENGINE, show_default=False),
]
FlowThresholdOpt = Annotated[
    Optional[float],
    typer.Option("--flow-threshold", help="flow policy: mean flow in pixels that makes a keyframe. \\[default: 15]",
                 rich_help_panel=_ENGINE, show_default=False),
]
MaxGapOpt = Annotated[
    Optional[int],
    typer.Option("--max-gap", help="flow policy: most frames in a row without a keyframe. \\[default: 30]",
                 rich_help_panel=_ENGINE, show_default=False),
]
ImageWidthOpt = Annotated[
    Optional[int],
    typer.Option("--image-width", help="Model input width in pixels, a multiple of 14. \\[default: 518]",
                 rich_help_panel=_ENGINE, show_default=False),
]
FpsOpt = Annotated[
    Optional[float],
    typer.Option(
        "--fps",
        help="Use at most this many frames per second of video (by timestamp). For an image folder: "
        "the rate its timestamps assume.",
        rich_help_panel=_SOURCE,
        show_default=False,
    ),
]
MaxFramesOpt = Annotated[
    Optional[int],
    typer.Option("--max-frames", help="Stop after this many frames.", rich_help_panel=_SOURCE, show_default=False),
]
StartOpt = Annotated[
    Optional[int],
    typer.Option("--start", help="First source frame to use (0-based). \\[default: 0]", rich_help_panel=_SOURCE,
                 show_default=False),
]
StrideOpt = Annotated[
    Optional[int],
    typer.Option("--stride", help="Use every N-th source frame. \\[default: 1]", rich_help_panel=_SOURCE,
                 show_default=False),
]
OpenTimeoutOpt = Annotated[
    Optional[float],
    typer.Option("--open-timeout", help="Seconds to wait for a stream URL to connect. \\[default: 10]",
                 rich_help_panel=_SOURCE, show_default=False),
]
ReconnectOpt = Annotated[
    Optional[float],
    typer.Option("--reconnect", help="Seconds to keep reconnecting, with back-off, to a live camera or stream "
                 "that drops mid-run (0: a drop ends the run). \\[default: 30]", rich_help_panel=_SOURCE,
                 show_default=False),
]
ConfThresholdOpt = Annotated[
    Optional[float],
    typer.Option("--conf-threshold", help="Keep points with depth confidence at least this in points.ply. "
                 "\\[default: 2]", rich_help_panel=_OUTPUT, show_default=False),
]
VoxelSizeOpt = Annotated[
    Optional[float],
    typer.Option("--voxel-size", help="Voxel size for points.ply, in model units. \\[default: automatic]",
                 rich_help_panel=_OUTPUT, show_default=False),
]
OverwriteOpt = Annotated[
    Optional[bool],
    typer.Option("--overwrite/--no-overwrite", help="Replace a run already in the output folder.",
                 rich_help_panel=_OUTPUT, show_default=False),
]
ViewerOpt = Annotated[
    Optional[bool],
    typer.Option("--viewer/--no-viewer", help="Open the live browser viewer. \\[default: viewer]",
                 rich_help_panel=_VIEWER, show_default=False),
]
KeepViewerOpt = Annotated[
    Optional[bool],
    typer.Option("--keep-viewer/--no-keep-viewer", help="Keep the viewer serving the result after the run "
                 "(Ctrl-C to exit).", rich_help_panel=_VIEWER, show_default=False),
]
HostOpt = Annotated[
    Optional[str],
    typer.Option("--host", help="Viewer address. \\[default: 127.0.0.1]", rich_help_panel=_VIEWER, show_default=False),
]
PortOpt = Annotated[
    Optional[int],
    typer.Option("--port", help="Viewer port (the next free one is used if taken). \\[default: 8080]",
                 rich_help_panel=_VIEWER, show_default=False),
]
OutputOpt = Annotated[
    Optional[Path],
    typer.Option("--output", "-o", help="Output folder. \\[default: outputs/<source name>]", rich_help_panel=_OUTPUT,
                 show_default=False),
]


def show_engine_log(console: Console) -> None:
    """Print the library's INFO messages (window rollovers, backend choice) above the progress line."""
    from rich.logging import RichHandler

    logger = logging.getLogger("stream_recon")
    if not any(isinstance(handler, RichHandler) for handler in logger.handlers):
        logger.addHandler(RichHandler(console=console, show_time=False, show_path=False, markup=False))
    logger.setLevel(logging.INFO)


def error_console() -> Console:
    # soft_wrap: an error sentence stays one line (the terminal wraps it), so paths are never split
    return Console(stderr=True, highlight=False, soft_wrap=True)


@contextlib.contextmanager
def user_errors(console: Console | None = None) -> Iterator[None]:
    """Turn the errors a user can fix into one red sentence and an exit code, without a traceback.

    Anything else is a bug and keeps its traceback.
    """
    from stream_recon.app.pipeline import OptionsError
    from stream_recon.app.presets import PresetError
    from stream_recon.app.sources import SourceError
    from stream_recon.app.writers import OutputDirError
    from stream_recon.models.errors import CheckpointError, FrameError

    console = console or error_console()
    try:
        yield
    except (SourceError, OutputDirError, CheckpointError, FrameError, PresetError, OptionsError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=EXIT_BAD_INPUT) from None
