"""Run every sequence of a dataset folder, resumably, serially or spread over a Ray cluster.

    OUTPUT/
      summary.json            [{name, source, kind, status, error, frames, keyframes, fps, ..., ate_rmse,
                               open_chain_ate_rmse, ...}]
      summary.csv             the same rows and columns
      <name>/                 one run directory per sequence (run.json, predictions/, trajectory_tum.txt, ...)
      <name>/eval.json        when the sequence has ground truth
      <name>/.complete        written last; holds the sequence's summary row and the settings it ran with

A sequence whose folder has `.complete` is skipped (its row is reused with status `skipped`); a folder
without it is the remains of a run that was killed or failed, and is deleted and redone. A sequence
that fails is recorded with its error and the batch goes on; the summary is rewritten after every
sequence, so a killed batch keeps what it finished.

A row carries the loops the run's pose graph used (`loops_accepted`) when its run.json reports loop
closure, and, for a run that loop closure corrected and that has ground truth, the ATE RMSE of its open
chain (`open_chain_ate_rmse`, eval.json's open_chain) beside the corrected one (`ate_rmse`).

A finished sequence is skipped only if it ran with the settings that change results
(options.RESULT_FIELDS: --image-width, --scale-frames, --keyframes, the checkpoint, ...). Otherwise
the batch refuses to start, naming what changed, and `--overwrite` redoes those sequences. A refusal
rather than a silent rerun, because the old results may have taken hours of GPU time and the user
may only have mistyped a flag; `--overwrite` replaces only what ran with other settings (sequences
finished with these settings are still skipped), so an interrupted `--overwrite` batch resumes.

Workers hold the model once and take sequences one at a time, the shape of Ray's
`ActorPool.map_unordered`: in-process (one worker) or one Ray actor per GPU (`--ray`). Results come
back as rows, never as exceptions, so one bad sequence cannot stop the others.

The summary's columns and files are batch_summary.py's; which finished sequences are skipped, batch_resume.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import shutil
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from stream_recon.app.evaluation.batch_resume import (
    SameCheckpoint,
    finished_row,
    outdated_message,
    result_changes,
)
from stream_recon.app.evaluation.batch_summary import (
    BASE_COLUMNS,
    EVAL_COLUMNS,
    OPEN_CHAIN_ATE_RMSE,
    write_summary,
)
from stream_recon.app.evaluation.datasets import Sequence, TumFrames
from stream_recon.app.evaluation.metrics import (
    DEFAULT_MAX_DIFF,
    OPEN_CHAIN,
    EvaluationError,
    evaluate_run,
    evaluation_path,
    write_evaluation,
)
from stream_recon.app.options import OptionsError, RunOptions
from stream_recon.app.outputs.output_folder import OutputDirError
from stream_recon.app.outputs.rundir import (
    BATCH_MARKER,
    PREDICTIONS_DIR,
    RunDirError,
    holds_run,
    run_accepted_loops,
    write_batch_marker,
)
from stream_recon.app.outputs.trajectories import TumFileError
from stream_recon.app.run.clock import finite_or_none
from stream_recon.app.run.loading import load_model_for
from stream_recon.app.run.pipeline import run_sequence
from stream_recon.app.sources.frames import SourceError
from stream_recon.models import CheckpointError, FrameError

logger = logging.getLogger(__name__)

COMPLETE_MARKER = BATCH_MARKER

ModelLoader = Callable[[], Any]


class BatchError(ValueError):
    """The batch cannot start: bad output folder, no usable Ray cluster, ..."""


class BatchInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped the batch; the summary holds everything finished before it."""

    def __init__(self, rows: list[dict], signum: int | None = None) -> None:
        super().__init__("batch interrupted")
        self.rows = rows
        self.signum = signum  # the signal that stopped the sequence running then (None: Ctrl-C elsewhere)


class SequenceStopped(KeyboardInterrupt):
    """A signal stopped the sequence being run; the batch stops after recording it."""

    def __init__(self, signum: int | None) -> None:
        super().__init__("sequence stopped")
        self.signum = signum


INTERRUPTED_ERROR = "stopped by a signal (Ctrl-C, SIGTERM); run the batch again to redo this sequence"


@dataclass(frozen=True)
class EvalSettings:
    """How sequences with ground truth are scored (see app.evaluation.metrics)."""

    alignment: str = "sim3"
    max_diff: float = DEFAULT_MAX_DIFF  # evo's; depth frames keep evaluate_run's own DEPTH_MAX_DIFF


# --------------------------------------------------------------------------------------------------
# One sequence


def run_dir_of(output_dir: Path, sequence: Sequence) -> Path:
    return Path(output_dir) / sequence.name


def sequence_source(sequence: Sequence) -> Any:
    """What `run_sequence` reads: the path of a video or image folder, or the TUM frame list."""
    if sequence.kind == "tum":
        return TumFrames(sequence.source)
    return str(sequence.source)


class SequenceWorker:
    """Holds one model and processes sequences one at a time; every outcome comes back as a row.

    Used directly for serial batches and wrapped as a Ray actor for distributed ones, so both paths
    run exactly the same code on each sequence. `console` receives the pipeline's per-frame progress
    (a quiet one inside Ray actors, whose terminal nobody watches).
    """

    def __init__(
        self,
        load_model: ModelLoader,
        run_options: RunOptions,
        output_dir: str | Path,
        evaluation: EvalSettings,
        console: Console | None = None,
    ) -> None:
        self.model = load_model()
        # A batch never opens the live viewer, and its resume rule (not --overwrite) decides what is redone.
        self.run_options = dataclasses.replace(run_options, viewer=False, overwrite=False)
        self.output_dir = Path(output_dir)
        self.evaluation = evaluation
        self.console = console or Console(quiet=True)
        self.stop_signal: int | None = None  # the signal that stopped the last sequence, if one did

    def process(self, sequence: Sequence) -> dict:
        run_dir = run_dir_of(self.output_dir, sequence)
        row = base_row(sequence)
        started = time.monotonic()
        try:
            if run_dir.exists():
                remove_partial_run(run_dir)  # its files would mix with the new ones
            summary = run_sequence(
                sequence_source(sequence), run_dir, self.run_options, model=self.model, console=self.console
            )
        except Exception as error:  # noqa: BLE001 - any failure is this sequence's, recorded, never fatal
            logger.debug("sequence %s failed:\n%s", sequence.name, traceback.format_exc())
            row.update(status="failed", error=describe_error(error), seconds=time.monotonic() - started)
            return row
        row.update(frames=summary.frames, keyframes=summary.keyframes, fps=finite_or_none(summary.fps))
        # a signal that came after the last frame leaves a complete run: recorded as done, then the batch stops
        self.stop_signal = summary.stop_signal or summary.late_signal
        if summary.status == "interrupted":  # not failed: stopped, and redone by the next batch as a failed one is
            row.update(status="interrupted", error=INTERRUPTED_ERROR, seconds=time.monotonic() - started)
            return row
        if summary.status != "complete":
            row.update(status="failed", error=summary.error or f"run ended {summary.status}")
            row["seconds"] = time.monotonic() - started
            return row
        row["status"] = "ok"
        loops_accepted = run_accepted_loops(run_dir)
        if loops_accepted is not None:
            row["loops_accepted"] = loops_accepted
        if sequence.gt_file is not None:
            row.update(self._evaluate(sequence, run_dir))
        row["seconds"] = time.monotonic() - started
        write_marker(run_dir, row, self.run_options.result_settings())
        return row

    def _evaluate(self, sequence: Sequence, run_dir: Path) -> dict:
        try:
            metrics = evaluate_run(
                run_dir,
                sequence.gt_file,
                alignment=self.evaluation.alignment,
                max_diff=self.evaluation.max_diff,
                depth_dir=sequence.depth_dir,
            )
            write_evaluation(metrics, evaluation_path(run_dir))
        except (EvaluationError, OSError) as error:
            # The reconstruction itself is fine and kept; only the comparison could not be made.
            return {"error": f"evaluation: {error}"}
        return evaluation_row(metrics)


def evaluation_row(metrics: dict) -> dict:
    """The summary columns of an evaluation (EVAL_COLUMNS that it holds), the open chain's ATE among them."""
    row = {key: metrics[key] for key in EVAL_COLUMNS if key in metrics}
    if OPEN_CHAIN in metrics:
        row[OPEN_CHAIN_ATE_RMSE] = metrics[OPEN_CHAIN]["ate_rmse"]
    return row


def remove_partial_run(run_dir: Path) -> None:
    """Delete what a killed or failed run left, but never a folder this program did not write."""
    # a run killed before its first file still has its predictions/ folder
    ours = holds_run(run_dir) or (run_dir / PREDICTIONS_DIR).is_dir()
    if run_dir.is_dir() and (ours or not any(run_dir.iterdir())):
        shutil.rmtree(run_dir)
        return
    raise BatchError(
        f"{run_dir} exists but is not a stream-recon run directory (no run.json or predictions/); "
        "it is left untouched: move it away or choose another --output"
    )


def base_row(sequence: Sequence) -> dict:
    row = dict.fromkeys(BASE_COLUMNS)
    row.update(name=sequence.name, source=str(sequence.source), kind=sequence.kind)
    return row


def describe_error(error: BaseException) -> str:
    # Ray colours its tracebacks; a summary cell should hold plain text.
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).strip()
    if text and isinstance(error, SEQUENCE_MISTAKES):  # a sentence for the user, as the CLI gives it
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__  # a bug: its class says so


# What a sequence's own input or output can be wrong with, each said as one sentence (a damaged video, a
# folder that cannot be written, a checkpoint): no class name in the summary, as none on the terminal.
SEQUENCE_MISTAKES = (SourceError, OutputDirError, RunDirError, TumFileError, CheckpointError, FrameError,
                     OptionsError)


def write_marker(run_dir: Path, row: dict, settings: dict) -> None:
    """The sequence's row and the result settings it ran with; written last, so it marks a finished run."""
    write_batch_marker(run_dir, {**row, "settings": settings})


# --------------------------------------------------------------------------------------------------
# The batch


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker is built from; sent as is to each Ray actor."""

    load_model: ModelLoader
    run_options: RunOptions
    output_dir: Path
    evaluation: EvalSettings

    def build(self, console: Console | None = None) -> SequenceWorker:
        return SequenceWorker(self.load_model, self.run_options, self.output_dir, self.evaluation, console)


def run_batch(
    sequences: list[Sequence],
    output_dir: str | Path,
    run_options: RunOptions,
    *,
    load_model: ModelLoader | None = None,
    evaluation: EvalSettings = EvalSettings(),
    ray_address: str | None = None,
    gpus_per_task: float = 1.0,
    overwrite: bool = False,
    console: Console | None = None,
    ray_log_level: int = logging.WARNING,
) -> list[dict]:
    """Process `sequences` into OUTPUT/<name>/ and write the summary; returns the rows in sequence order.

    A sequence finished with other result settings is an error (BatchError, before any model loads)
    unless `overwrite`, which redoes it; one finished with these settings is skipped either way.

    `load_model` (default: the checkpoint, device and dtype of `run_options`) is called once per
    worker: once here, or once per Ray actor, so for Ray it must be picklable (a module-level
    function, a functools.partial of one, or a closure cloudpickle can carry).
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise BatchError(f"--output {output_dir} exists and is not a folder; choose another path")
    _check_no_overlap(output_dir, sequences)
    console = console or Console(stderr=True)
    spec = WorkerSpec(
        load_model or functools.partial(load_model_for, run_options), run_options, output_dir, evaluation
    )
    rows: dict[str, dict] = {}
    pending = []
    outdated: dict[str, list[str]] = {}  # sequence name -> what changed
    same_checkpoint = SameCheckpoint(run_options.checkpoint)
    for sequence in sequences:
        run_dir = run_dir_of(output_dir, sequence)
        previous = finished_row(run_dir)
        changes = [] if previous is None else result_changes(run_dir, run_options, same_checkpoint)
        if previous is None or changes:
            pending.append(sequence)
            if changes:
                outdated[sequence.name] = changes
        else:
            rows[sequence.name] = {**previous, "status": "skipped"}
    if outdated and not overwrite:
        raise BatchError(outdated_message(output_dir, outdated, len(sequences)))
    # Ray is joined and asked for its resources, or the model loaded, before anything is written: a
    # refusal (no GPU in the cluster, a missing checkpoint) leaves nothing behind
    ray_session = (_RaySession.join(ray_address, gpus_per_task, len(pending), ray_log_level)
                   if pending and ray_address else None)
    try:
        worker = spec.build(console) if pending and ray_session is None else None
        _prepare_output_dir(output_dir)
    except BaseException:
        if ray_session is not None:
            ray_session.close()
        raise

    def ordered_rows() -> list[dict]:
        return [rows[s.name] for s in sequences if s.name in rows]

    def record(row: dict) -> None:
        rows[row["name"]] = row
        write_summary(output_dir, ordered_rows())
        _report(console, row)

    write_summary(output_dir, ordered_rows())
    if rows and pending:
        console.print(f"{len(rows)} of {len(sequences)} sequences already finished in {output_dir}: skipped")
    if rows and not pending:
        console.print(f"all {len(sequences)} sequences already finished in {output_dir}")
    try:
        if ray_session is not None:
            with ray_session:
                _run_actors(ray_session.ray, ray_session.actors, pending, spec, console, record,
                            ray_session.gpus_per_task)
        elif pending:
            _run_serial(pending, worker, console, record)
    except KeyboardInterrupt as interrupt:
        write_summary(output_dir, ordered_rows())
        raise BatchInterrupted(ordered_rows(), getattr(interrupt, "signum", None)) from None
    write_summary(output_dir, ordered_rows())
    return ordered_rows()


def _check_no_overlap(output_dir: Path, sequences: list[Sequence]) -> None:
    """Run directories are deleted when partial, so none may be, hold or sit inside a sequence's input."""
    for sequence in sequences:
        run_dir = run_dir_of(output_dir, sequence).resolve()
        source = sequence.source.resolve()
        if run_dir == source or run_dir in source.parents or source.is_dir() and source in run_dir.parents:
            raise BatchError(
                f"--output {output_dir} overlaps the input: the run directory {run_dir} of sequence "
                f"{sequence.name} would be, contain or sit inside {source}; choose an --output outside the dataset "
                "folders (a sibling folder, or a subfolder of ROOT that holds no sequence)"
            )


def _prepare_output_dir(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise BatchError(f"cannot create --output {output_dir}: {error.strerror or error}") from None


def _report(console: Console, row: dict) -> None:
    if row["status"] == "ok":
        detail = f"{row['frames']} frames"
        if row.get("fps") is not None:
            detail += f", {row['fps']:.1f} FPS"
        if row.get("loops_accepted") is not None:
            detail += f", {row['loops_accepted']} loops accepted"
        if row.get("ate_rmse") is not None:
            detail += f", ATE RMSE {row['ate_rmse']:.4f}"
        if row.get(OPEN_CHAIN_ATE_RMSE) is not None:
            detail += f" (open chain {row[OPEN_CHAIN_ATE_RMSE]:.4f})"
        if row.get("error"):
            detail += f" ({row['error']})"
        console.print(f"[green]ok[/] {row['name']}: {detail}")
    else:
        console.print(f"[red]failed[/] {row['name']}: {row['error']}")


def _run_serial(pending: list[Sequence], worker: SequenceWorker, console: Console, record) -> None:
    """One worker in this process; the pipeline draws each sequence's frame progress on `console`."""
    # rich allows one live display per console, so sequences are counted in lines and frames in the bar.
    for number, sequence in enumerate(pending, start=1):
        heading = f"sequence {number}/{len(pending)}: {sequence.name} ({sequence.describe()})"
        # a rule spans the console's width: a terminal's, or in a log (app.commands._options.output_console) a
        # thousand columns
        if console.is_terminal:
            console.rule(heading)
        else:
            console.print(f"-- {heading}")
        row = worker.process(sequence)
        record(row)
        if worker.stop_signal is not None:
            # The pipeline turned the signal into a clean stop of this sequence; the batch stops with it.
            raise SequenceStopped(worker.stop_signal)


# --------------------------------------------------------------------------------------------------
# Ray


def connect_ray(address: str, log_level: int = logging.WARNING) -> tuple[Any, bool]:
    """Join the Ray cluster at `address`; `auto` joins a running one or starts a local instance.
    `log_level`: what Ray's own log shows on the terminal (the CLI: its warnings only with --verbose).

    Returns (the ray module, whether this call started Ray and so should shut it down). A Ray already
    initialised in this process (a notebook, a test) is used as it is.
    """
    try:
        import ray  # an optional extra: only for --ray
    except ImportError:
        raise BatchError("--ray needs Ray: run scripts/setup-env ray in the checkout (or pip install 'stream-recon[ray]' where the wheel is installed)") from None
    if ray.is_initialized():
        return ray, False
    if address == "auto":
        try:
            ray.init(address="auto", logging_level=log_level)
        except ConnectionError:
            # Nothing to join: start a private instance, reachable from this machine only.
            ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", logging_level=log_level)
        return ray, True
    try:
        ray.init(address=address, logging_level=log_level)
    except ConnectionError as error:
        raise BatchError(f"cannot reach the Ray cluster at {address}: {error}") from None
    return ray, True


def plan_actors(resources: dict, gpus_per_task: float, sequences: int) -> int:
    """How many workers the cluster can hold at once: one per `gpus_per_task` GPUs, or one per CPU."""
    if gpus_per_task > 0:
        gpus = resources.get("GPU", 0.0)
        if gpus < gpus_per_task:
            raise BatchError(
                f"the Ray cluster has {gpus:g} GPU(s) but each sequence asks for {gpus_per_task:g}; "
                "add GPU nodes, or pass --gpus-per-task 0 to run on CPUs"
            )
        capacity = int(gpus // gpus_per_task)
    else:
        capacity = int(resources.get("CPU", 1.0))
    return max(1, min(capacity, sequences))


class _RaySession:
    """The Ray cluster a batch runs on, joined and sized before the batch writes anything: a cluster
    without the GPUs the batch asks for is refused with nothing left behind."""

    def __init__(self, ray: Any, started_here: bool, gpus_per_task: float, actors: int) -> None:
        self.ray = ray
        self.started_here = started_here
        self.gpus_per_task = gpus_per_task
        self.actors = actors

    @classmethod
    def join(cls, address: str, gpus_per_task: float, sequences: int, log_level: int) -> _RaySession:
        ray, started_here = connect_ray(address, log_level)
        try:
            actors = plan_actors(ray.cluster_resources(), gpus_per_task, sequences)
        except BaseException:
            if started_here:
                ray.shutdown()
            raise
        return cls(ray, started_here, gpus_per_task, actors)

    def __enter__(self) -> _RaySession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self.started_here:
            self.ray.shutdown()
            self.started_here = False


def _run_actors(
    ray, count: int, pending: list[Sequence], spec: WorkerSpec, console: Console, record, gpus_per_task: float
):
    """One actor per GPU share (or CPU), each holding the model; sequences handed out as actors free up.

    This is ActorPool.map_unordered with one addition: each result is tied to its sequence, so a
    worker that dies (out of memory, lost node) fails that sequence by name and the others go on.
    """
    actor_class = ray.remote(SequenceWorker).options(num_gpus=gpus_per_task, num_cpus=1)
    actors = [
        actor_class.remote(spec.load_model, spec.run_options, str(spec.output_dir), spec.evaluation)
        for _ in range(count)
    ]
    waiting = list(reversed(pending))
    running: dict[Any, tuple[Any, Sequence]] = {}

    def submit(actor) -> None:
        if waiting:
            sequence = waiting.pop()
            running[actor.process.remote(sequence)] = (actor, sequence)

    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    try:
        with progress:
            task = progress.add_task(f"sequences on {count} Ray worker(s)", total=len(pending))
            for actor in actors:
                submit(actor)
            while running:
                [finished], _ = ray.wait(list(running), num_returns=1)
                actor, sequence = running.pop(finished)
                try:
                    row = ray.get(finished)
                except Exception as error:  # noqa: BLE001 - a dead actor: crash, OOM, failed model load
                    row = {**base_row(sequence), "status": "failed"}
                    row["error"] = f"Ray worker failed: {describe_error(error)}"
                    actor = None  # a dead actor takes no more work
                record(row)
                progress.advance(task)
                if actor is not None:
                    submit(actor)
                elif not running:
                    # Every worker has died: what is left cannot run here, and the summary says why.
                    while waiting:
                        record({**base_row(waiting.pop()), "status": "failed", "error": row["error"]})
                        progress.advance(task)
    finally:
        for actor in actors:
            ray.kill(actor)
