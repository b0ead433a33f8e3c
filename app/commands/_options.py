"""Options shared by `run` and `batch`, declared once, and the error boundary of every command.

Every run option defaults to None, meaning "not given": the value then comes from the preset
(`--config`) or RunOptions' default, so that a preset never silently beats a flag the user typed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import os
import typing
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Annotated, Any, NoReturn, Optional

import rich
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from stream_recon.app.evaluation.settings import DEFAULT_MAX_DIFF
from stream_recon.app.options import FLAG_NAMES, MAX_CAMERA_ITERATIONS, OptionsError, PresetError, RunOptions
from stream_recon.app.outputs.atomic_writes import OutputPathError
from stream_recon.app.outputs.output_folder import OutputDirError
from stream_recon.app.outputs.rundir import RunDirError
from stream_recon.app.outputs.trajectories import TumFileError
from stream_recon.app.sources.frames import SourceError
from stream_recon.app.sources.input_size import PATCH_SIZE
from stream_recon.app.stopping import interrupts_held
from stream_recon.models import (
    DEFAULT_CHECKPOINT,
    FLOW_THRESHOLD,
    KNOWN_CHECKPOINTS,
    MAX_GAP,
    CheckpointError,
    FrameError,
    keyframe_spellings,
)

_MODEL = "Model"
_ENGINE = "Streaming engine"
_SOURCE = "Source"
_OUTPUT = "Outputs"
_VIEWER = "Live viewer"

# Exit codes, the same for every command: a run that failed part-way (what it computed is kept), bad
# input or options (nothing ran; one line `error: ...`), a run stopped by Ctrl-C or by SIGTERM
# (128 + the signal's number, as a shell reports a process the signal ended: app.stopping).
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


def _optional_flag(kind: type, *names: str, help: str, panel: str | None = None, **limits: Any) -> Any:
    """An option that is None when not given, so that a preset or RunOptions' default applies."""
    return Annotated[Optional[kind], typer.Option(*names, help=help, rich_help_panel=panel, show_default=False,
                                                  **limits)]


# The evaluation flags of `eval` and of `batch` (which shows them in its own panel). Their
# defaults are app.evaluation.settings' (DEFAULT_MAX_DIFF), applied by app.evaluation.metrics when the flag is
# not given (the commands pass only what was typed).
ALIGNMENTS = ("sim3", "se3")


def evaluation_flags(panel: str | None = None) -> tuple[Any, Any]:
    """(--alignment, --max-diff) as the evaluating commands declare them; `panel`: their help panel."""
    alignment = Annotated[str, typer.Option(
        "--alignment", help="Evaluation alignment: sim3 (evo's -as; scale too, for monocular runs) or se3 (-a).",
        rich_help_panel=panel,
    )]
    max_diff = _optional_flag(
        float, "--max-diff", min=0.0, panel=panel,
        help="Evaluation: largest timestamp difference (s) of an estimated and a ground-truth pose "
        f"(evo's --t_max_diff). \\[default: {DEFAULT_MAX_DIFF}]",
    )
    return alignment, max_diff


def given(**values: Any) -> dict[str, Any]:
    """The flags that were typed, by name (a flag not given is None): passed on as keywords, so that the
    default of a value is applied once, by the function or dataclass that owns it."""
    return {name: value for name, value in values.items() if value is not None}


def check_alignment(console: Console, alignment: str) -> None:
    """Refuse an --alignment the evaluation does not know, before any work starts."""
    if alignment not in ALIGNMENTS:
        bad_input(console, f"--alignment must be {' or '.join(ALIGNMENTS)}, not {alignment!r}")


ConfigOpt = _optional_flag(
    str, "--config",
    help="Run preset: a name from configs/ (indoor, outdoor, low-memory) or a YAML file. Flags override it.",
)
OutputOpt = _optional_flag(
    Path, "--output", "-o", help="Output folder. \\[default: outputs/<source name>]", panel=_OUTPUT
)

# The help of every RunOptions field's flag, by panel, in --help order, without its default: `[default: ...]`
# is added from the field's default (_shown_default). The flag itself is the field's name with dashes
# (`--scale-frames`), a boolean's with its `--no-` pair, and its type the field's.
_RUN_OPTION_HELP: dict[str, dict[str, str]] = {
    _MODEL: {
        "checkpoint": f"Checkpoint path (.pt or .safetensors) or name ({', '.join(KNOWN_CHECKPOINTS)}).",
        "device": "auto, cpu, cuda or cuda:N.",
        "dtype": "Transformer precision: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16.",
        # the backend table imports torch: `stream-recon info` lists it, and a wrong name is refused with the list
        "attention": "Attention backend: auto (the fastest that runs here) or a backend's name; `stream-recon info` "
        "lists them, what each is and whether it runs here.",
        "compile": "Fuse the blocks and heads with torch.compile (CUDA only), 9% faster per frame at 518x392: auto "
        "(compiled where this machine compiled the input size before; a new size streams uncompiled at once "
        "while it compiles beside the run for the next one), on (compiled before the first frame: 20-40 s the "
        "first time), or off.",
        "warm_up": "Before the first frame, run the streaming step on copies of it (compiled, recorded as a CUDA "
        "graph) so that the stream never waits for that: auto (where the step compiles or is recorded: CUDA), on, "
        "or off (the first streaming frame waits instead).",
        "memory_check": "CPU runs: refuse settings whose memory estimate exceeds the available memory, naming smaller "
        "ones that fit.",
        "kv_cache": "K/V cache precision: auto (the model's: bf16 on a GPU) or fp8 (e4m3 with a scale per token "
        "and head: half the bytes; read by our kernel and the SDPA reference).",
        "gpu_memory": "Device-memory budget, e.g. 8GiB: before the first frame the run is planned to fit it (the fp8 "
        "cache, then a shorter window, said and recorded in run.json), or refused with the smallest budget that "
        "fits.",
    },
    _ENGINE: {
        "scale_frames": "Frames processed together at the start and kept forever.",
        "window": "Sliding window of recent frames whose patch tokens stay visible.",
        "chunk_frames": "Long streams: cached frames per chunk before a new chunk starts (a fresh cache), aligned on the "
        "overlap.",
        "overlap": "Long streams: frames two consecutive chunks share.",
        "loop_closure": "Long streams: when the camera returns to a place seen two or more chunks earlier, correct "
        "the drift between them (a pose graph over chunks; the uncorrected trajectory is kept as "
        "trajectory_open_tum.txt): auto (on when gtsam imports and the stream can reach a third chunk, past "
        "2 x (chunk frames - overlap) frames: a loop joins chunks two or more apart), on, or off.",
        "extend_map": "Extend the map of an earlier run (a folder a run with loop closure wrote): this stream's "
        "keyframes are looked up in it too, and once a loop to it is verified the outputs are in that run's frame "
        "(the viewer shows its points beside); the earlier run is only read. Needs loop closure and the same "
        "checkpoint.",
        "keyframes": f"Keyframe policy: {keyframe_spellings()}.",
        "flow_threshold": "flow policy: mean flow in pixels that makes a keyframe.",
        "max_gap": "flow policy: most frames in a row without a keyframe.",
        "image_width": f"Model input width in pixels, a multiple of {PATCH_SIZE}.",
        "camera_iterations": "Refinement iterations of the camera head, 1 to the checkpoint's count (the released "
        f"models': {MAX_CAMERA_ITERATIONS}): fewer run faster for a small pose error (the reference demo's "
        "--camera_num_iterations).",
    },
    _SOURCE: {
        "fps": "Use at most this many frames per second of video (by timestamp). For an image folder: the rate "
        "its timestamps assume (without it, frames are 1 s apart: give the camera's rate for evaluations and "
        "exports that read timestamps).",
        "max_frames": "Stop after this many frames.",
        "start": "First source frame to use (0-based).",
        "stride": "Use every N-th source frame.",
        "rotate": "Turn every frame this many degrees clockwise before the model sees it (0, 90, 180 or 270): a "
        "video recorded sideways. Exports read the source again turned the same way.",
        "open_timeout_s": "Seconds to wait for a stream URL to connect.",
        "reconnect_s": "Live cameras and streams: seconds to keep reconnecting (with back-off) after a drop before "
        "the run ends as failed; 0 makes a drop the end of the stream.",
    },
    _OUTPUT: {
        "conf_threshold": "Keep points with depth confidence at least this in points.ply.",
        "voxel_size": "Voxel size for points.ply, in model units (one too fine for the scene's grid, under about "
        "1/16000 of the first frame's median depth, is raised to it with a warning).",
        # (a bracket is rich markup in help: the extra's is escaped)
        "mask_sky": "Leave the sky out of points.ply, the viewer and every export: the reference demo's sky network "
        "(skyseg.onnx, fetched once with `stream-recon download skyseg`), run with onnxruntime beside the stream "
        "(its install: `scripts/setup-env sky` in a checkout, the \\[sky] extra of a wheel); each npz keeps its "
        "frame's mask (sky_mask).",
        "mask_dir": "A folder of one mask image per frame, 0 where a pixel is left out of every point (nerfstudio's "
        "convention): dynamic objects, say. Named as the frames' exported images (NNNNNN.png, the frame index), "
        "or in natural order; drawn on the frames as turned by --rotate, at their size or the model input's.",
        "overwrite": "Replace a run already in the output folder.",
        "save_depth": "Precision of depth and confidence in predictions/*.npz: float16 (half the bytes, relative "
        "error at most 0.05%) or float32 (the model's output exactly).",
        "save_images": "Keep the model input image in each predictions/*.npz (colours for exports and replays; "
        "0.56 MiB a frame at 518x378).",
        "save_predictions": "Which frames get a predictions/*.npz: all, or keyframes (every frame's pose stays in "
        "trajectory_tum.txt; points.ply, like every export, is built from the saved frames).",
    },
    _VIEWER: {
        "viewer": "Open the live browser viewer.",
        "keep_viewer": "Keep the viewer serving the result after the run, until Ctrl-C.",
        "show": "What the viewer draws for each keyframe: points, or splats (a Gaussian per point, as wide as the "
        "points' spacing, its opacity from the depth confidence; heavier for the browser).",
        "host": "Address the viewer serves on; 0.0.0.0 exposes it to the network.",
        "port": "Port the viewer serves on (the next free one if taken).",
    },
}


def _as_typed(value: Any) -> str:
    """A value as a user would type it: 15 for 15.0, 0.01 as it is."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


# The defaults --help words otherwise than as the field's value: a None that stands for a value owned
# elsewhere (read from its owner), or a value `run` chooses when the flag is not given (app.commands.run).
# A field with a None default and no wording here shows none (--fps, --max-frames: no limit).
_DEFAULT_WORDING: dict[str, str] = {
    "checkpoint": DEFAULT_CHECKPOINT,
    "gpu_memory": "none",
    "chunk_frames": f"{RunOptions.chunk_frames}, the trained range",
    "flow_threshold": _as_typed(FLOW_THRESHOLD),
    "max_gap": _as_typed(MAX_GAP),
    "voxel_size": "automatic",
    "camera_iterations": "all, the checkpoint's count",
    "overwrite": "no-overwrite; a run of the bundled sample replaces its earlier run in outputs/sample/",
    "keep_viewer": "keep-viewer on a terminal, else no-keep-viewer",
}


_FIELD_DEFAULTS = {field.name: field.default for field in dataclasses.fields(RunOptions)}


def _flag_names(field: str, kind: type) -> tuple[str, ...]:
    names = FLAG_NAMES.get(field, (f"--{field.replace('_', '-')}",))
    if kind is bool:
        return (f"{names[0]}/--no-{names[0].removeprefix('--')}", *names[1:])
    return names


def _shown_default(field: str, kind: type) -> str | None:
    """A field's default as --help shows it: a boolean as the flag that gives it (`viewer`, `no-viewer`),
    a number as typed (2, not 2.0); None when there is none to show."""
    if field in _DEFAULT_WORDING:
        return _DEFAULT_WORDING[field]
    default = _FIELD_DEFAULTS[field]
    if default is None:
        return None
    if kind is bool:
        on, off = _flag_names(field, bool)[0].split("/")
        return (on if default else off).removeprefix("--")
    return _as_typed(default)


def _run_option_flag(field: str, help: str, panel: str) -> Any:
    """The flag of one RunOptions field: named after it, of its type (`float | None` -> float)."""
    annotation = typing.get_type_hints(RunOptions)[field]
    kind = next(arg for arg in (typing.get_args(annotation) or (annotation,)) if arg is not type(None))
    default = _shown_default(field, kind)
    if default is not None:
        help = f"{help} \\[default: {escape(default)}]"
    return _optional_flag(kind, *_flag_names(field, kind), help=help, panel=panel)


# The flag of every RunOptions field; `takes_run_options` gives them to a command, and `view` takes the
# viewer's address (--host, --port) from here too.
RUN_OPTION_FLAGS: dict[str, Any] = {
    field: _run_option_flag(field, help, panel)
    for panel, helps in _RUN_OPTION_HELP.items()
    for field, help in helps.items()
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


class EngineLog(logging.Handler):
    """The library's log on a command's console. A warning is one line `warning: ...`, as the commands' own
    warnings are printed; the INFO records `--verbose` shows (chunk rollovers, the next chunk ahead) are laid out
    by rich on a terminal (level, then the message wrapped beside it), elsewhere (a log file, a pipe) one line
    per record as long as the record, because rich lays a record out at the console's width, 80 columns when it
    is no terminal, wrapped and padded."""

    def __init__(self, console: Console) -> None:

        super().__init__()
        self.console = console
        self.on_terminal = RichHandler(console=console, show_time=False, show_path=False, markup=False)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if record.levelno >= logging.WARNING:
                self.console.print(f"[yellow]warning:[/yellow] {escape(self.format(record))}", highlight=False)
            elif self.console.is_terminal:
                self.on_terminal.emit(record)
            else:
                self.console.out(f"{record.levelname:<8} {self.format(record)}", highlight=False)
        except Exception:  # noqa: BLE001 - logging's rule: a handler that fails reports it and the program goes on
            self.handleError(record)


def show_engine_log(console: Console) -> None:
    """Print the library's warnings above the progress line, and its INFO messages (chunk rollovers, backend
    choice) with --verbose: a run's own lines say what a user needs."""
    logger = logging.getLogger("stream_recon")
    if not any(isinstance(handler, EngineLog) for handler in logger.handlers):
        logger.addHandler(EngineLog(console))
    logger.setLevel(logging.INFO if _verbose else logging.WARNING)


_verbose = False


def set_verbosity(verbose: bool) -> None:
    """--verbose (any command): the libraries' own messages on stderr and every line of an error's details.

    Without it, viser's banner, OpenCV's log (`[ WARN:0@0.1] global cap.cpp:212 ...`), FFmpeg's (`[mpeg4 @ 0x...] header
    damaged`, `[tcp @ 0x...] Connection refused`), Ray's warnings (library_log_level), Hugging Face's retries and
    Python warnings stay quiet, so that a bad input is the one `error:` line. OpenCV reads its level when it loads and FFmpeg's at its first capture, both after
    this (commands import them when they run); a level the user set in the environment is kept.
    """
    global _verbose
    _verbose = verbose
    if not verbose:
        os.environ.setdefault("OPENCV_LOG_LEVEL", "SILENT")
        os.environ.setdefault("OPENCV_FFMPEG_LOGLEVEL", "-8")  # AV_LOG_QUIET
        warnings.simplefilter("ignore")
        # rich's shared console is what libraries print through (viser's banner box and its "Server stopped"
        # on stdout); stream-recon's own lines go through consoles of their own
        rich.reconfigure(quiet=True)
        # huggingface_hub logs each retry of a request ("... thrown while requesting HEAD ... Retrying in 8s"): a
        # download that fails ends in one error line of ours
        logging.getLogger("huggingface_hub").setLevel(logging.ERROR)


def library_log_level() -> int:
    """The level a library's own Python log (Ray's) is shown from: its warnings with --verbose, else only
    its errors (set_verbosity)."""
    return logging.WARNING if _verbose else logging.ERROR


def error_line(message: str) -> str:
    """An error as one line: a library's multi-line details (a checkpoint's tensors, a YAML parser's
    context) are shown with --verbose only."""
    headline, _, details = message.strip().partition("\n")
    if not details.strip():
        return headline
    if _verbose:
        return message.strip()
    return f"{headline.rstrip('.:; ')} (--verbose shows the details)"


def import_held(module: str) -> ModuleType:
    """Import the module a command's work runs in with Ctrl-C held until the import is done: it loads
    torch and Triton, and a Ctrl-C inside their native set-up would abort the process (app/stopping.py)."""

    with interrupts_held():
        return importlib.import_module(module)


# Off a terminal rich lays out at 80 columns: a table there is squeezed to this width instead, so that a row
# stays one line in a file or a pipe (a table is as wide as its cells need, never wider)
UNWRAPPED_WIDTH = 1000


def output_console(*, stderr: bool = False, highlight: bool = True) -> Console:
    """A command's console on stdout or stderr. A terminal wraps its lines at its width; a file or a pipe
    (a log) gets every line whole, tables included: rich wrapped at 80 columns there, a warning or a path
    split over lines. COLUMNS, when set, is the width either way."""
    console = Console(stderr=stderr, highlight=highlight)
    if console.is_terminal or "COLUMNS" in os.environ:
        return console
    return Console(stderr=stderr, highlight=highlight, soft_wrap=True, width=UNWRAPPED_WIDTH)


def error_console() -> Console:
    """stderr's output_console; soft_wrap on a terminal too: an error sentence stays one line (the terminal
    wraps it), so paths are never split."""
    console = output_console(stderr=True, highlight=False)
    console.soft_wrap = True
    return console


def bad_input(console: Console, message: str) -> NoReturn:
    """Say what was wrong in one line and exit with the bad-input code."""
    console.print(f"[red]error:[/red] {escape(error_line(message))}")
    raise typer.Exit(code=EXIT_BAD_INPUT)


@contextlib.contextmanager
def user_errors(console: Console | None = None, *more: type[Exception]) -> Iterator[None]:
    """Turn the errors a user can fix into one line `error: ...` and exit code 2, without a traceback.

    more: a command's own kinds of bad input (ExportError, EvaluationError, ...), besides the ones
    every command can meet. Anything else is a bug and keeps its traceback.
    """

    console = console or error_console()
    try:
        yield
    except (SourceError, OutputDirError, OutputPathError, RunDirError, TumFileError, CheckpointError, FrameError,
            PresetError, OptionsError, *more) as error:
        bad_input(console, str(error))


@contextlib.contextmanager
def stop_said(console: Console, outcome: str) -> Iterator[None]:
    """A stop signal (Ctrl-C, SIGTERM) that ends a command's work said in one line, with what it left: the
    stop's own `outcome` where it carries one (an export's), else `outcome`; the process then exits by it."""
    try:
        yield
    except KeyboardInterrupt as stop:
        with interrupts_held():
            console.print(f"[yellow]interrupted[/yellow]: {escape(getattr(stop, 'outcome', outcome))}")
        raise
