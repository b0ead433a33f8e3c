"""One run: a source streamed through the engine into the run directory and any other sinks.

    open source ─▶ check options ─▶ check output dir ─▶ load model ─▶ RunWriter ─▶ per frame: push ─▶ sinks
        │               │                 │                  │                                  │
        SourceError     OptionsError      OutputDirError     CheckpointError       SIGINT / SIGTERM / a source,
        (before torch   (e.g. no CUDA)    (before the load)  (no folder left)      frame or disk error: stop,
         is imported)                                                              flush, close the sinks

Every failure before the first frame leaves nothing behind but a clear error. Once frames flow,
every completed prediction is already on disk (the writer flushes per frame), so stopping early
only has to flush what the engine still buffers and write run.json with how the run ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import signal
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
from rich.console import Console

from stream_recon.app.preprocess import DEFAULT_IMAGE_WIDTH, PATCH_SIZE, preprocess_frame
from stream_recon.app.progress import RunProgress
from stream_recon.app.sources import (
    DEFAULT_OPEN_TIMEOUT_S,
    DEFAULT_RECONNECT_S,
    FrameSelection,
    FrameSource,
    SourceError,
    frames_source,
    open_source,
)
from stream_recon.app.writers import PREDICTIONS_DIR, RUN_JSON, OutputDirError, RunWriter

logger = logging.getLogger(__name__)

DEFAULT_CHECKPOINT = "lingbot-map-long"
# models.engine.ATTENTION_BACKENDS, repeated so that options are checked before torch is imported.
ATTENTION_CHOICES = ("auto", "dense", "dense-triton", "dense-flashinfer", "dense-cudnn", "sdpa", "flashinfer",
                     "flashinfer-fa2", "flashinfer-fa3")
MAX_WINDOW_FRAMES = 1024  # positions in the model's temporal RoPE table
RunStatus = Literal["complete", "interrupted", "failed"]
DTYPE_NAMES = {"auto": None, "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
               "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


class OptionsError(ValueError):
    """Run options that are out of range or do not fit this machine (e.g. CUDA asked for, none here)."""


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """Everything a run needs besides the source and the output folder. Defaults are the reference's.

    The CLI, presets (configs/*.yaml) and the batch runner all build one of these; field names are
    the preset keys.
    """

    # model
    checkpoint: str | None = None  # path or known name; None: lingbot-map-long
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 transformer on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    attention: str = "auto"  # one of ATTENTION_CHOICES
    compile: bool = True  # torch.compile the transformer blocks (CUDA only)
    # engine
    scale_frames: int = 8
    window: int = 64
    # long streams: a new window (fresh cache, aligned by Sim(3) on `overlap` shared frames) starts
    # before the cache holds more than `window_frames` frames, the range the model was trained on
    window_frames: int = 320
    overlap: int = 16
    keyframes: str = "all"  # all | interval:N | flow
    flow_threshold: float | None = None  # None: the engine's default
    max_gap: int | None = None  # flow policy: longest run of non-keyframes; None: engine default
    image_width: int = DEFAULT_IMAGE_WIDTH
    # source
    fps: float | None = None
    max_frames: int | None = None
    start: int = 0
    stride: int = 1
    open_timeout_s: float = DEFAULT_OPEN_TIMEOUT_S
    reconnect_s: float = DEFAULT_RECONNECT_S  # a live source that drops is retried this long; 0: never
    # outputs
    conf_threshold: float = 2.0
    voxel_size: float | None = None  # None: automatic, relative to the first frame's depth
    overwrite: bool = False
    # live viewer
    viewer: bool = True
    host: str = "127.0.0.1"
    port: int = 8080
    keep_viewer: bool = False  # after the run, keep serving the result until Ctrl-C

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise OptionsError("; ".join(problems))

    def _problems(self) -> Iterator[str]:
        if self.dtype not in DTYPE_NAMES:
            yield f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}"
        if self.attention not in ATTENTION_CHOICES:
            yield f"attention must be one of {', '.join(ATTENTION_CHOICES)}, got {self.attention!r}"
        if self.scale_frames < 1:
            yield f"scale_frames must be >= 1, got {self.scale_frames}"
        if self.window < 1:
            yield f"window must be >= 1, got {self.window}"
        if not self.scale_frames < self.window_frames <= MAX_WINDOW_FRAMES:
            yield (
                f"window_frames must be more than scale_frames ({self.scale_frames}) and at most "
                f"{MAX_WINDOW_FRAMES} (the temporal RoPE table), got {self.window_frames}"
            )
        if not 1 <= self.overlap < self.window_frames:
            yield f"overlap must be between 1 and window_frames - 1 ({self.window_frames - 1}), got {self.overlap}"
        if not _is_keyframe_policy(self.keyframes):
            yield f"keyframes must be all, flow or interval:N (N >= 1), got {self.keyframes!r}"
        if self.image_width <= 0 or self.image_width % PATCH_SIZE:
            yield f"image_width must be a positive multiple of {PATCH_SIZE}, got {self.image_width}"
        if self.flow_threshold is not None and not self.flow_threshold > 0:
            yield f"flow_threshold must be > 0, got {self.flow_threshold}"
        if self.max_gap is not None and self.max_gap < 1:
            yield f"max_gap must be >= 1, got {self.max_gap}"
        if self.open_timeout_s <= 0:
            yield f"open_timeout_s must be > 0, got {self.open_timeout_s}"
        if not self.reconnect_s >= 0:
            yield f"reconnect_s must be >= 0 (0: never reconnect), got {self.reconnect_s}"
        if not 0 < self.port < 65536:
            yield f"port must be between 1 and 65535, got {self.port}"
        try:
            self.selection()
        except ValueError as error:
            yield str(error)

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    def selection(self) -> FrameSelection:
        return FrameSelection(start=self.start, stride=self.stride, fps=self.fps, max_frames=self.max_frames)

    def stream_config_kwargs(self) -> dict[str, Any]:
        """StreamConfig arguments; unset optional values are left to the engine's defaults."""
        kwargs: dict[str, Any] = dict(
            scale_frames=self.scale_frames, window=self.window, keyframes=self.keyframes, attention=self.attention,
            compile=self.compile,
        )
        if self.flow_threshold is not None:
            kwargs["flow_threshold"] = self.flow_threshold
        if self.max_gap is not None:
            kwargs["max_gap"] = self.max_gap
        return kwargs

    def as_settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _is_keyframe_policy(text: str) -> bool:
    if text in ("all", "flow"):
        return True
    name, _, interval = text.partition(":")
    return name == "interval" and interval.isdigit() and int(interval) >= 1


@dataclass(frozen=True)
class RunSummary:
    """How a run ended. `frames` counts predictions on disk (distinct frame indices)."""

    status: RunStatus
    frames: int
    keyframes: int
    fps: float  # end to end: frames / wall time from the first frame read to the last prediction
    output_dir: Path
    error: str | None = None
    model_fps: float = float("nan")  # frames / time spent inside the engine
    frames_read: int = 0
    end_reason: str | None = None  # end | max_frames | stopped | error

    @property
    def ok(self) -> bool:
        return self.status == "complete"


class Sink(Protocol):
    def on_frame(self, pred: Any, stats: dict) -> None: ...

    def close(self, status: str) -> None: ...


# ----------------------------------------------------------------------------------------------


def run_sequence(
    source: str | Path | FrameSource | Iterable[tuple[np.ndarray, float]],
    output_dir: str | Path,
    options: RunOptions,
    *,
    model: Any = None,
    extra_sinks: Sequence[Sink] = (),
    console: Console | None = None,
) -> RunSummary:
    """Stream `source` through the model into `output_dir`; returns how the run ended.

    source: what the user typed (video, folder, webcam index, URL), an opened FrameSource, or any
    iterable of (rgb [H, W, 3] uint8, timestamp) pairs. model: an already loaded model (batch runs
    share one); when None it is loaded from options.checkpoint after the output folder is checked.

    Errors before the first frame (a bad source, an unwritable folder, a missing checkpoint) are
    raised; the user gets them as one sentence from the CLI. Errors while streaming (a truncated
    video, a stalled camera, a frame of another size) end the run as "failed": what was computed is
    kept and RunSummary.error says why. Ctrl-C or SIGTERM ends it as "interrupted" the same way.
    """
    console = console or Console(stderr=True)
    output_dir = Path(output_dir)
    frame_source = _as_frame_source(source, options)  # first: a mistyped path fails before torch loads
    try:
        device = resolve_device(options.device)
        check_attention(options.attention, device)
        created_dir = prepare_output_dir(output_dir, overwrite=options.overwrite)
        if frame_source.live:
            frame_source.start()  # keep a camera's connection drained while the model loads
        viewer = None
        try:
            # a caller's own model is described by options.checkpoint only when that is set
            checkpoint = options.checkpoint or (DEFAULT_CHECKPOINT if model is None else None)
            model = model if model is not None else load_model_for(options, device, console)
            digest = _CheckpointDigest(checkpoint)
            engine = _build_engine(model, options, device, resolve_dtype(options.dtype, device), console)
            viewer = _start_viewer(options, console)
            writer = RunWriter(
                output_dir,
                _settings(options, frame_source, device, checkpoint),
                conf_threshold=options.conf_threshold,
                voxel_size=options.voxel_size,
                overwrite=True,  # prepare_output_dir already refused an existing run without --overwrite
            )
        except BaseException:
            if viewer is not None:
                viewer.close("failed")
            _remove_if_empty(output_dir, created_dir)
            raise
        sinks: list[Sink] = [writer, *extra_sinks]
        if viewer is not None:
            sinks.append(viewer)
        return _stream(frame_source, engine, writer, sinks, viewer, options, device, console, digest)
    finally:
        frame_source.close()


def _stream(
    frame_source: FrameSource,
    engine: Any,
    writer: RunWriter,
    sinks: list[Sink],
    viewer: Any,
    options: RunOptions,
    device: str,
    console: Console,
    digest: _CheckpointDigest,
) -> RunSummary:
    from stream_recon.models.errors import FrameError

    stream_errors = (SourceError, FrameError, OutputDirError)
    clock = _RunClock()
    status: RunStatus = "complete"
    error: str | None = None
    with _StopOnSignal(frame_source.request_stop, console) as stop:
        with RunProgress(console, frame_source.description, frame_source.estimated_length) as progress:
            try:
                try:
                    for frame in frame_source:
                        if viewer is not None:
                            _wait_while_paused(viewer, stop)
                        image = frame.image
                        if image is None:  # a FrameSource opened without preprocessing
                            image = preprocess_frame(frame.rgb, options.image_width)
                        preds = clock.time_engine(engine.push, image, timestamp=frame.timestamp)
                        clock.frames_read += 1
                        progress.update(_emit(preds, engine, clock, sinks, frame_source))
                except stream_errors as failure:
                    # a source, frame or disk problem mid-stream: the frames before it are worth keeping
                    status, error = "failed", str(failure)
                # what the engine still buffers (phase 1) is completed on every path but a second Ctrl-C
                try:
                    preds = clock.time_engine(engine.finish)
                    progress.update(_emit(preds, engine, clock, sinks, frame_source))
                except stream_errors as failure:
                    status, error = "failed", error or str(failure)
            except KeyboardInterrupt:
                status = "interrupted"
            except BaseException as unexpected:
                _close_sinks(
                    sinks, writer, "failed", clock, frame_source, device, f"internal error: {unexpected!r}", digest
                )
                raise
        if stop.requested and status == "complete":
            status = "interrupted"
        writer_error = _close_sinks(sinks, writer, status, clock, frame_source, device, error, digest)
    if writer_error is not None and error is None:
        status, error = "failed", writer_error
    summary = RunSummary(
        status=status,
        frames=len(writer.poses),
        keyframes=sum(1 for pose in writer.poses.values() if pose.is_keyframe),
        fps=clock.end_to_end_fps,
        output_dir=writer.output_dir,
        error=error,
        model_fps=clock.model_fps,
        frames_read=clock.frames_read,
        end_reason=frame_source.end_reason or ("stopped" if stop.requested else None),
    )
    _report(summary, console)
    if viewer is not None and options.keep_viewer and not stop.requested:
        _serve_until_interrupted(viewer, console)
    return summary


def _wait_while_paused(viewer: Any, stop: _StopOnSignal) -> None:
    # short waits, so that Ctrl-C still stops a run paused from the browser
    while not viewer.wait_if_paused(timeout=0.2):
        if stop.requested:
            return


def _serve_until_interrupted(viewer: Any, console: Console) -> None:
    console.print(f"viewer still serving the result at [bold]{viewer.url}[/bold]; Ctrl-C to exit")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        viewer.stop()


def _emit(preds: list, engine: Any, clock: _RunClock, sinks: list[Sink], source: FrameSource) -> dict:
    clock.count_done(preds)
    stats = dict(engine.stats())
    stats.update(
        clock.rates(), frames_read=clock.frames_read, frames_done=clock.frames_done,
        frames_dropped=source.frames_dropped,
    )
    for pred in preds:
        for sink in sinks:
            sink.on_frame(pred, stats)
    return stats


def _close_sinks(
    sinks: list[Sink],
    writer: RunWriter,
    status: RunStatus,
    clock: _RunClock,
    source: FrameSource,
    device: str,
    error: str | None,
    digest: _CheckpointDigest,
) -> str | None:
    """Close every sink, the writer with the run's summary. Returns the writer's error, if any."""
    summary = {
        "checkpoint_digest": digest.result(),
        "status": status,
        "error": error,
        "device": device,
        "source": source.description,
        "end_reason": source.end_reason,
        "frames_read": clock.frames_read,
        "frames_dropped": source.frames_dropped,
        "reconnects": source.reconnects,
        "reconnect_attempts": source.reconnect_attempts,
        "disconnected_s": round(source.disconnected_s, 3),
        **clock.rates(),
        "timings": clock.timings(),
        "peak_gpu_memory_bytes": _peak_gpu_memory(device),
    }
    writer_error = None
    for sink in sinks:
        try:
            if sink is writer:
                writer.close(status, summary)
            else:
                sink.close(status)
        except OutputDirError as failure:
            writer_error = str(failure)
        except Exception as failure:  # noqa: BLE001 - one sink failing must not stop the others closing
            logger.warning("closing %s failed: %s", type(sink).__name__, failure)
    return writer_error


def _report(summary: RunSummary, console: Console) -> None:
    line = (
        f"{summary.frames} frames ({summary.keyframes} keyframes) at {summary.fps:.1f} FPS end to end, "
        f"{summary.model_fps:.1f} FPS in the model -> {summary.output_dir}"
    )
    if summary.status == "complete":
        console.print(f"[green]done[/green]: {line}")
    elif summary.status == "interrupted":
        console.print(f"[yellow]interrupted[/yellow]: {line}")
    else:
        console.print(f"[red]failed[/red]: {summary.error}\n  kept {line}")


# ----------------------------------------------------------------------------------------------
# Setup


def resolve_device(device: str) -> str:
    """`auto` -> cuda when available, else cpu. An unavailable CUDA is an error, not a silent CPU run."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise OptionsError(f"device {device!r} was asked for but CUDA is not available here; use --device cpu")
        index = device.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise OptionsError(
                f"device {device!r} does not exist: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
        return device
    if device != "cpu":
        raise OptionsError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    return device


def check_attention(attention: str, device: str) -> None:
    """A CUDA-only backend asked for explicitly must be usable here; `auto` picks a usable one itself."""
    if "flashinfer" not in attention and attention not in ("dense-cudnn", "dense-triton"):
        return
    if not device.startswith("cuda"):
        raise OptionsError(f"--attention {attention} runs on CUDA only, but the device is {device}; use sdpa or auto")
    if attention == "dense-cudnn":
        return
    if attention == "dense-triton":
        try:
            import triton  # noqa: F401 - only whether it imports matters here
        except ImportError as error:
            raise OptionsError(
                f"--attention dense-triton needs the triton package ({error.msg}), which CUDA builds of torch "
                "bring along; use --attention auto"
            ) from None
        return
    try:
        import flashinfer  # noqa: F401 - only whether it imports matters here
    except ImportError as error:
        raise OptionsError(
            f"--attention {attention} needs the flashinfer package ({error.msg}); "
            "install it with pip install 'stream-recon[cuda]', or use --attention auto"
        ) from None


def prepare_output_dir(output_dir: Path, *, overwrite: bool) -> bool:
    """Make sure `output_dir` can take a run, before any model is loaded. Returns True if created here."""
    if output_dir.exists() and not output_dir.is_dir():
        raise OutputDirError(f"output path {output_dir} exists and is not a directory; choose another --output")
    predictions = output_dir / PREDICTIONS_DIR
    holds_run = (output_dir / RUN_JSON).exists() or (predictions.is_dir() and any(predictions.glob("*.npz")))
    if holds_run and not overwrite:
        raise OutputDirError(
            f"output directory {output_dir} already holds a run; choose another --output or pass --overwrite"
        )
    created = not output_dir.exists()
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as error:
        raise OutputDirError(
            f"cannot write to the output directory {output_dir}: {error.strerror or error}; "
            "choose a writable --output"
        ) from None
    return created


def _remove_if_empty(output_dir: Path, created: bool) -> None:
    # A run that never started should not leave a folder that blocks the next attempt.
    if created:
        with contextlib.suppress(OSError):
            for child in (output_dir / "predictions", output_dir):
                if child.is_dir() and not any(child.iterdir()):
                    child.rmdir()


def _as_frame_source(source: Any, options: RunOptions) -> FrameSource:
    if isinstance(source, FrameSource):
        return source
    if isinstance(source, (str, Path)):
        return open_source(
            source, options.selection(), image_width=options.image_width, open_timeout_s=options.open_timeout_s,
            reconnect_s=options.reconnect_s,
        )
    name = getattr(source, "name", None) or type(source).__name__
    return frames_source(source, options.selection(), name=str(name), image_width=options.image_width)


def load_model_for(options: RunOptions, device: str | None = None, console: Console | None = None) -> Any:
    """The model `options` name, as every command loads it (`run`, and `batch` once per worker).

    Load the checkpoint; a known name not on this machine is downloaded first when the hub is reachable
    (the first run), else CheckpointError says which command fetches it and where to put it."""
    from stream_recon.models import load_model
    from stream_recon.models.checkpoint import (
        KNOWN_CHECKPOINTS,
        download_checkpoint,
        hub_offline,
        locate_checkpoint,
    )

    device = device or resolve_device(options.device)
    console = console or Console(stderr=True)
    checkpoint = options.checkpoint or DEFAULT_CHECKPOINT
    if checkpoint in KNOWN_CHECKPOINTS and not Path(checkpoint).exists() and locate_checkpoint(checkpoint) is None:
        if not hub_offline():
            # no spinner here: huggingface_hub draws its own progress bar
            console.print(f"{checkpoint} is not on this machine yet: downloading it once (about 4.6 GB)")
            checkpoint = str(download_checkpoint(checkpoint))
    # weights stay float32: the engine runs the transformer under autocast and the heads in fp32
    with console.status(f"loading {checkpoint} on {device}"):
        return load_model(checkpoint, device=device)


class _CheckpointDigest:
    """sha256 of the checkpoint file for run.json, hashed on a thread: 4.6 GB takes seconds, which
    the run should not wait for. A checkpoint that cannot be resolved has no digest."""

    def __init__(self, checkpoint: str | None) -> None:
        self._digest: str | None = None
        self._thread: threading.Thread | None = None
        if checkpoint is not None:
            self._thread = threading.Thread(target=self._compute, args=(checkpoint,), name="digest", daemon=True)
            self._thread.start()

    def _compute(self, checkpoint: str) -> None:
        from stream_recon.models.checkpoint import checkpoint_digest, resolve_checkpoint
        from stream_recon.models.errors import CheckpointError

        try:
            self._digest = checkpoint_digest(resolve_checkpoint(checkpoint))
        except (CheckpointError, OSError):
            self._digest = None

    def result(self, timeout_s: float = 60.0) -> str | None:
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self._digest


def resolve_dtype(name: str, device: str) -> Any:
    """`auto`: bf16 on CUDA (fp16 before Ampere, which has no fast bf16), fp32 on CPU, as the reference."""
    import torch

    canonical = DTYPE_NAMES[name]
    if canonical is not None:
        return getattr(torch, canonical)
    if not device.startswith("cuda"):
        return torch.float32
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def _build_engine(model: Any, options: RunOptions, device: str, dtype: Any, console: Console) -> Any:
    from stream_recon.models import StreamConfig
    from stream_recon.models.windowed import WindowedEngine

    config = StreamConfig(**options.stream_config_kwargs())
    # a stream shorter than one window runs exactly as a plain StreamingEngine would
    engine = WindowedEngine(
        model, config, window_frames=options.window_frames, overlap=options.overlap, device=device, dtype=dtype
    )
    engine.on_backend_ready = lambda name: _announce_backend(name, console)
    return engine


def _announce_backend(name: str, console: Console) -> None:
    """The first FlashInfer call compiles its kernels: say so, rather than stall silently."""
    if name.startswith("flashinfer"):
        seconds = "about 90 s" if name.endswith("fa3") else "about 30 s"
        console.print(
            f"attention: {name}; its kernels compile on first use on this machine ({seconds}, once: they are "
            "cached in ~/.cache/flashinfer)"
        )
    else:
        console.print(f"attention: {name}")


def _start_viewer(options: RunOptions, console: Console) -> Any:
    if not options.viewer:
        return None
    from stream_recon.app.viewer import LiveViewer  # viser is heavy: only imported when asked for

    viewer = LiveViewer(options.host, options.port, keep_serving=options.keep_viewer)
    console.print(f"live viewer: [bold]{viewer.url}[/bold]")
    return viewer


def _settings(options: RunOptions, source: FrameSource, device: str, checkpoint: str | None) -> dict[str, Any]:
    settings = options.as_settings()
    settings.update(
        source=source.description,
        source_kind=source.kind,
        device_resolved=device,
        checkpoint=checkpoint or "model passed in by the caller",
    )
    return settings


def _peak_gpu_memory(device: str) -> int | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return int(torch.cuda.max_memory_allocated(device))


# ----------------------------------------------------------------------------------------------
# Timing and signals


class _RunClock:
    """Frame counts and the two rates the user cares about: the model's and the whole pipeline's."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.first_frame_at: float | None = None
        self.model_seconds = 0.0
        self.frames_read = 0
        self.frames_done = 0  # distinct frames predicted: a windowed stream re-emits some frames
        self._highest_index = -1

    def count_done(self, preds: list) -> None:
        for pred in preds:
            if pred.frame_index > self._highest_index:  # emissions of new frames come in index order
                self._highest_index = pred.frame_index
                self.frames_done += 1

    def time_engine(self, call: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        if self.first_frame_at is None:
            self.first_frame_at = started
        try:
            return call(*args, **kwargs)
        finally:
            self.model_seconds += time.perf_counter() - started

    @property
    def model_fps(self) -> float:
        return self.frames_done / self.model_seconds if self.model_seconds > 0 else float("nan")

    @property
    def end_to_end_fps(self) -> float:
        if self.first_frame_at is None:
            return float("nan")
        elapsed = time.perf_counter() - self.first_frame_at
        return self.frames_done / elapsed if elapsed > 0 else float("nan")

    def rates(self) -> dict[str, float]:
        return {"model_fps": _finite_or_none(self.model_fps), "fps": _finite_or_none(self.end_to_end_fps)}

    def timings(self) -> dict[str, float | None]:
        first = None if self.first_frame_at is None else self.first_frame_at - self.started
        return {
            "total_s": round(time.perf_counter() - self.started, 3),
            "until_first_frame_s": None if first is None else round(first, 3),
            "model_s": round(self.model_seconds, 3),
        }


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


class _StopOnSignal:
    """First SIGINT/SIGTERM: finish the current frame, flush, save. Second: stop flushing, save.
    Any further one is ignored, so the files being written are not cut off.

    Handlers can only be installed from the main thread; elsewhere (a batch worker thread) the
    caller's own handling applies and this does nothing.
    """

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_first: Any, console: Console) -> None:
        self._on_first = on_first
        self._console = console
        self._previous: dict[int, Any] = {}
        self.count = 0

    @property
    def requested(self) -> bool:
        return self.count > 0

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for signum in self._SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: object) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            self._on_first()
            self._console.print(f"[yellow]{name}: stopping after this frame and saving (again: stop now)[/yellow]")
        elif self.count == 2:
            self._console.print(f"[yellow]{name}: stopping now; writing the files of the frames done[/yellow]")
            raise KeyboardInterrupt
