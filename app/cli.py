"""`stream-recon`: the root command only registers subcommands (one module per command in commands/).

`stream-recon SOURCE` is short for `stream-recon run SOURCE`. Click takes the first positional as
a command name, so `main` inserts `run` when the first argument is not a command or a root option.
`stream-recon` alone is `stream-recon run`, which reconstructs the bundled sample.
"""

# ruff: noqa: E402 - the handler below must be in place before the other imports run

from __future__ import annotations

import codecs
import os
import signal
import sys
import threading


def _exit_interrupted(signum: int, frame: object) -> None:
    os.write(2, b"interrupted while stream-recon started: nothing was done\n")  # (a handler: no buffered print)
    sys.exit(130)  # 128 + SIGINT, as app.stopping's PromptInterrupt exits later on


# Ctrl-C while the CLI itself loads (typer, rich, numpy: a few hundred ms on a busy machine) exits 130, as a
# shell reports it, with one line instead of a KeyboardInterrupt traceback; main() then hands
# Ctrl-C to PromptInterrupt. Importing this module from elsewhere (tests) leaves the handler as it was.
_handler_before_import = None
if threading.current_thread() is threading.main_thread():
    _handler_before_import = signal.signal(signal.SIGINT, _exit_interrupted)

from importlib import metadata
from types import ModuleType
from typing import Annotated, Any

import typer
from rich.markup import escape
from typer.core import TyperCommand, TyperGroup

from stream_recon.app.commands import batch, convert, download, export, info, localise, refine, run, view
from stream_recon.app.commands import eval as evaluation
from stream_recon.app.commands._options import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    error_console,
    set_verbosity,
)
from stream_recon.app.outputs.formats import format_summary
from stream_recon.app.stopping import STOP_SIGNALS, PromptInterrupt, end_process, interrupted_exit_code

if _handler_before_import is not None:
    signal.signal(signal.SIGINT, _handler_before_import)


def _flags_shown_without_a_type(command: Any, context: Any) -> None:
    """A flag (--viewer/--no-viewer, -h) takes no value: typer's help would show `<bool>` beside each."""
    for parameter in command.get_params(context):
        if getattr(parameter, "is_flag", False):
            parameter.metavar = ""


class HelpOfFlags(TyperCommand):
    """A command whose help shows its flags without a value's type (_flags_shown_without_a_type)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _flags_shown_without_a_type(self, ctx)
        super().format_help(ctx, formatter)


class OneLineUsageErrors(TyperGroup):
    """Usage errors (an unknown option, a value of the wrong type, a missing argument) as every other
    bad input is reported: one line `error: ...` and exit code 2, instead of typer's boxed panel. Its help
    shows the root's flags without a type, as each command's (HelpOfFlags)."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _flags_shown_without_a_type(self, ctx)
        super().format_help(ctx, formatter)

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except typer.TyperException as error:  # click's exceptions (typer vendors click) derive from it
            if not standalone_mode:
                raise
            if type(error).__name__ != "NoArgsIsHelpError":  # that one has printed the help already
                error_console().print(f"[red]error:[/red] {escape(usage_error_line(error))}")
            sys.exit(EXIT_BAD_INPUT)  # click's exceptions are all about what was typed
        except typer.Abort:  # end of input at a prompt: nothing to report but the exit code
            if not standalone_mode:
                raise
            sys.exit(EXIT_FAILED)
        if not standalone_mode:
            return result
        # without standalone mode an Exit comes back as its code, a command's own return as None
        sys.exit(result if isinstance(result, int) else 0)


def usage_error_line(error: typer.TyperException) -> str:
    """Click's message on one line, and where the usage is explained."""
    message = " ".join(error.format_message().split()).rstrip(".")
    context = getattr(error, "ctx", None)  # usage errors know the command they are about
    if context is not None:
        message += f"; `{context.command_path} -h` shows the usage"
    return message


app = typer.Typer(
    name="stream-recon",
    cls=OneLineUsageErrors,
    help="Streaming 3D reconstruction from video: camera poses and depth, frame by frame, live in the browser.\n\n"
    "Run [bold]stream-recon SOURCE[/bold] (a video, an image folder, a webcam index or a stream URL) "
    "or one of the commands below. [bold]stream-recon[/bold] alone reconstructs a bundled 14-frame sample.",
    context_settings={"help_option_names": ["-h", "--help"]},
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_show_locals=False,
)


def examples(module: ModuleType) -> str:
    """The example lines of a command module's docstring, as the command's help epilog."""
    doc = module.__doc__ or ""
    # the aligned trailing comments would wrap in an 80-column terminal; the module doc keeps them
    lines = [
        line.partition("  #")[0].strip()
        for line in doc.partition("Examples:")[2].splitlines()
        if line.startswith("    ")
    ]
    return "Examples:\n\n" + "\n".join(lines) if lines else ""


def register(module: ModuleType, name: str, summary: str) -> None:
    """Add the command `name`, the function of that name in `module`, with its examples."""
    app.command(name=name, help=summary, epilog=examples(module), cls=HelpOfFlags)(getattr(module, name))


register(run, "run", "Reconstruct a video, image folder, webcam or stream (the default command).")
register(info, "info", "Versions, CUDA/GPU, attention backends, loop closure, checkpoint locations.")
register(download, "download", "Download an official checkpoint into the Hugging Face cache.")
register(export, "export", f"Export a run directory as {format_summary()}.")
register(view, "view", "Replay a finished run in the browser, with a timeline.")
register(refine, "refine", "Refine a finished run offline: every keyframe indexed, a finer pose graph solved.")
register(localise, "localise", "Place query frames in a finished run's map: a pose in its world for each, or why not.")
register(convert, "convert", "Convert a .pt checkpoint to .safetensors.")
register(batch, "batch", "Run every sequence under a dataset folder, resumably; Ray spreads it over GPUs.")
app.command(
    name="eval",
    help="Score a run against ground truth: ATE and RPE as evo_ape / evo_rpe -as print them "
    "(-a with --alignment se3), pose AUC, depth.",
    epilog=examples(evaluation),
    cls=HelpOfFlags,
)(evaluation.eval_command)

ROOT_OPTIONS = ("-h", "--help", "--version", "--verbose")
VERBOSE = "--verbose"


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"stream-recon {metadata.version('stream-recon')}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", help="Show the version and exit.", callback=_version_callback, is_eager=True)
    ] = False,
    verbose: Annotated[
        bool,
        typer.Option(VERBOSE, help="Show the libraries' own messages (OpenCV, FFmpeg, warnings) and every detail of "
                     "an error; anywhere on the line: stream-recon clip.mp4 --verbose."),
    ] = False,
) -> None:
    """Root options only; every action is a command."""
    set_verbosity(verbose)


def command_names() -> set[str]:
    names = {command.name for command in app.registered_commands if command.name}
    names |= {group.name for group in app.registered_groups if group.name}
    return names


# Flags of earlier versions, spelled as they are now: scripts that use them keep working.
EARLIER_FLAGS = {"--no-compile": ["--compile", "off"]}


def with_default_command(args: list[str]) -> list[str]:
    """Insert `run` unless the first argument is a command or a root option. --verbose may come anywhere
    before a `--`: it is moved to the front, where the root takes it for every command. A flag of an
    earlier version (EARLIER_FLAGS) is replaced by today's spelling."""
    end = args.index("--") if "--" in args else len(args)
    verbose = VERBOSE in args[:end]
    args = [part for arg in args[:end] if arg != VERBOSE for part in EARLIER_FLAGS.get(arg, [arg])] + args[end:]
    if not (args and (args[0] in command_names() or args[0] in ROOT_OPTIONS)):
        args = ["run", *args]
    return [VERBOSE, *args] if verbose else args


# A path whose bytes are not UTF-8 holds lone surrogates in Python (os.fsdecode): printed, each showed as
# "\udcff"; it shows as the byte it stands for, "\xff", as run.json writes it (json_records.write_json_atomic).
UNDECODABLE_BYTES = "stream-recon-bytes"


def _show_undecodable_bytes(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeEncodeError):
        raise error
    shown = "".join(f"\\x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else f"\\u{ord(char):04x}"
                    for char in error.object[error.start:error.end])
    return shown, error.end


def _print_undecodable_bytes_as_bytes() -> None:
    codecs.register_error(UNDECODABLE_BYTES, _show_undecodable_bytes)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):  # a TextIOWrapper (not a test's capture)
            stream.reconfigure(errors=UNDECODABLE_BYTES)


def main(argv: list[str] | None = None) -> None:
    whole_process = argv is None and threading.current_thread() is threading.main_thread()
    code: object = 0
    try:
        _run_command(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exiting:
        if not whole_process:
            raise
        code = exiting.code
    finally:
        if whole_process:
            # The program's work is done (its record and last line written): a stop signal now ends the process
            # by that signal at once, as a shell expects, instead of a KeyboardInterrupt printed while the
            # interpreter joins threads at exit, after "done:" and with exit code 0.
            for signum in STOP_SIGNALS:
                signal.signal(signum, signal.SIG_DFL)
    if whole_process:
        end_process(code)


def _run_command(args: list[str]) -> None:
    _print_undecodable_bytes_as_bytes()
    # Every command's heavy libraries are imported when it runs (commands/*): Ctrl-C and SIGTERM must stop
    # it there too
    with PromptInterrupt() as interrupt:
        try:
            app(args=with_default_command(args), prog_name="stream-recon")
        except KeyboardInterrupt:  # one that came before typer's own handling, or after it
            sys.exit(interrupted_exit_code(interrupt.signum))
        except SystemExit as exiting:
            # typer reports every KeyboardInterrupt as 130, the one PromptInterrupt raised for SIGTERM too
            if exiting.code == EXIT_INTERRUPTED and interrupt.signum is not None:
                sys.exit(interrupted_exit_code(interrupt.signum))
            raise
        except Exception:
            # After a stop signal an error is the stop's doing: a library that catches the KeyboardInterrupt
            # while it imports fails later in its own way (trimesh keeps a stand-in for its path module and its
            # next annotation raises TypeError). The stop is reported, not that traceback.
            if interrupt.signum is not None:
                sys.exit(interrupted_exit_code(interrupt.signum))
            raise
        finally:
            interrupt.honoured()


if __name__ == "__main__":
    main()
