"""Options shared by `run` and `batch`, declared once, and the error boundary of every command.

Every run option defaults to None, meaning "not given": the value then comes from the preset
(`--config`) or RunOptions' default, so that a preset never silently beats a flag the user typed.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Optional

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

def _optional_flag(kind: type, *names: str, help: str, panel: str | None = None) -> Any:
    """An option that is None when not given, so that a preset or RunOptions' default applies."""
    return Annotated[Optional[kind], typer.Option(*names, help=help, rich_help_panel=panel, show_default=False)]


ConfigOpt = _optional_flag(
    str, "--config",
    help="Run preset: a name from configs/ (indoor, outdoor, low-memory) or a YAML file. Flags override it.",
)
OutputOpt = _optional_flag(
    Path, "--output", "-o", help="Output folder. \\[default: outputs/<source name>]", panel=_OUTPUT
)

# The flag of every RunOptions field, in --help order; `takes_run_options` gives them to a command.
RUN_OPTION_FLAGS: dict[str, Any] = {
    "checkpoint": _optional_flag(
        str, "--checkpoint", "-c",
        help="Checkpoint path (.pt or .safetensors) or name (lingbot-map-long, lingbot-map). "
        "\\[default: lingbot-map-long]",
        panel=_MODEL,
    ),
    "device": _optional_flag(str, "--device", help="auto, cpu, cuda or cuda:N. \\[default: auto]", panel=_MODEL),
    "dtype": _optional_flag(
        str, "--dtype",
        help="Transformer precision: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16. \\[default: auto]",
        panel=_MODEL,
    ),
    "attention": _optional_flag(
        str, "--attention",
        help="Attention backend: auto (CUDA: dense-triton on Hopper, else dense-flashinfer if installed, else "
        "dense; CPU: sdpa), dense, dense-triton, dense-cudnn, dense-flashinfer (contiguous cache), sdpa, "
        "flashinfer (= flashinfer-fa2), flashinfer-fa3 (paged cache). \\[default: auto]",
        panel=_MODEL,
    ),
    "compile": _optional_flag(
        bool, "--compile/--no-compile",
        help="Fuse the transformer blocks with torch.compile (CUDA only): about 20% faster per frame; the first "
        "run on a machine compiles for a minute or two, later runs read the cache. \\[default: compile]",
        panel=_MODEL,
    ),
    "scale_frames": _optional_flag(
        int, "--scale-frames", help="Frames processed together at the start and kept forever. \\[default: 8]",
        panel=_ENGINE,
    ),
    "window": _optional_flag(
        int, "--window", help="Sliding window of recent frames whose patch tokens stay visible. \\[default: 64]",
        panel=_ENGINE,
    ),
    "window_frames": _optional_flag(
        int, "--window-frames",
        help="Long streams: cached frames per window before a new window starts, aligned on the overlap. "
        "\\[default: 320, the trained range]",
        panel=_ENGINE,
    ),
    "overlap": _optional_flag(
        int, "--overlap", help="Long streams: frames two consecutive windows share. \\[default: 16]", panel=_ENGINE
    ),
    "keyframes": _optional_flag(
        str, "--keyframes", help="Keyframe policy: all, interval:N or flow. \\[default: all]", panel=_ENGINE
    ),
    "flow_threshold": _optional_flag(
        float, "--flow-threshold", help="flow policy: mean flow in pixels that makes a keyframe. \\[default: 15]",
        panel=_ENGINE,
    ),
    "max_gap": _optional_flag(
        int, "--max-gap", help="flow policy: most frames in a row without a keyframe. \\[default: 30]",
        panel=_ENGINE,
    ),
    "image_width": _optional_flag(
        int, "--image-width", help="Model input width in pixels, a multiple of 14. \\[default: 518]", panel=_ENGINE
    ),
    "fps": _optional_flag(
        float, "--fps",
        help="Use at most this many frames per second of video (by timestamp). For an image folder: "
        "the rate its timestamps assume.",
        panel=_SOURCE,
    ),
    "max_frames": _optional_flag(int, "--max-frames", help="Stop after this many frames.", panel=_SOURCE),
    "start": _optional_flag(
        int, "--start", help="First source frame to use (0-based). \\[default: 0]", panel=_SOURCE
    ),
    "stride": _optional_flag(int, "--stride", help="Use every N-th source frame. \\[default: 1]", panel=_SOURCE),
    "open_timeout_s": _optional_flag(
        float, "--open-timeout", help="Seconds to wait for a stream URL to connect. \\[default: 10]", panel=_SOURCE
    ),
    "conf_threshold": _optional_flag(
        float, "--conf-threshold",
        help="Keep points with depth confidence at least this in points.ply. \\[default: 2]",
        panel=_OUTPUT,
    ),
    "voxel_size": _optional_flag(
        float, "--voxel-size", help="Voxel size for points.ply, in model units. \\[default: automatic]",
        panel=_OUTPUT,
    ),
    "overwrite": _optional_flag(
        bool, "--overwrite/--no-overwrite", help="Replace a run already in the output folder.", panel=_OUTPUT
    ),
    "viewer": _optional_flag(
        bool, "--viewer/--no-viewer", help="Open the live browser viewer. \\[default: viewer]", panel=_VIEWER
    ),
    "keep_viewer": _optional_flag(
        bool, "--keep-viewer/--no-keep-viewer",
        help="Keep the viewer serving the result after the run (Ctrl-C to exit).",
        panel=_VIEWER,
    ),
    "host": _optional_flag(str, "--host", help="Viewer address. \\[default: 127.0.0.1]", panel=_VIEWER),
    "port": _optional_flag(
        int, "--port", help="Viewer port (the next free one is used if taken). \\[default: 8080]", panel=_VIEWER
    ),
}


def takes_run_options(*fields: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command the flags of these RunOptions fields (RUN_OPTION_FLAGS), after its own parameters.

    The command declares one parameter `overrides` instead, and is called with
    overrides = {field: the value typed, or None when the flag was not given}: exactly what
    `presets.build_options` takes. Each flag is spelled, documented and tied to its field once.
    """
    unknown = [field for field in fields if field not in RUN_OPTION_FLAGS]
    if unknown:
        raise ValueError(f"no flag for {', '.join(unknown)}; RunOptions fields with one: {', '.join(RUN_OPTION_FLAGS)}")

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        signature = inspect.signature(command, eval_str=True)
        own = [parameter for name, parameter in signature.parameters.items() if name != "overrides"]
        flags = [
            inspect.Parameter(field, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=RUN_OPTION_FLAGS[field])
            for field in fields
        ]

        @functools.wraps(command)
        def with_run_options(*args: Any, **kwargs: Any) -> None:
            overrides = {field: kwargs.pop(field, None) for field in fields}
            command(*args, **kwargs, overrides=overrides)

        # typer reads the parameters from the signature and their types from the annotations
        with_run_options.__signature__ = signature.replace(parameters=[*own, *flags])
        with_run_options.__annotations__ = {parameter.name: parameter.annotation for parameter in (*own, *flags)}
        return with_run_options

    return decorate


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
    from stream_recon.app.options import OptionsError
    from stream_recon.app.presets import PresetError
    from stream_recon.app.rundir import OutputDirError
    from stream_recon.app.sources import SourceError
    from stream_recon.models.errors import CheckpointError, FrameError

    console = console or error_console()
    try:
        yield
    except (SourceError, OutputDirError, CheckpointError, FrameError, PresetError, OptionsError) as error:
        console.print(f"[red]error:[/red] {error}")
        raise typer.Exit(code=EXIT_BAD_INPUT) from None
