"""The model and engine a run uses: the checkpoint loaded (downloaded on first use), its digest, the engine.

Every command that reconstructs goes through here: `run` once per run, `batch` once per worker.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from rich.console import Console

from stream_recon import models
from stream_recon.app.options import OptionsError, RunOptions, resolve_device, resolve_dtype
from stream_recon.app.stopping import swallowed_signal
from stream_recon.models import (
    CheckpointError,
    ChunkedEngine,
    MemoryBudgetError,
    ModelConfig,
    StreamConfig,
    chunk_stream_config,
)
from stream_recon.models.attention_backends import auto_fallback_reason, backend_summary, first_use_note
from stream_recon.models.builds.compilation import artefacts_dir
from stream_recon.models.checkpoint import (
    CHECKPOINT_SIZE,
    DEFAULT_CHECKPOINT,
    checkpoint_config,
)
from stream_recon.models.errors import checkpoint_advice
from stream_recon.models.hub_paths import (
    KNOWN_CHECKPOINTS,
    checkpoint_digest,
    download_checkpoint,
    hub_offline,
    locate_checkpoint,
    resolve_checkpoint,
)
from stream_recon.models.supervision import Helper, HelperPolicy, WhenDown, WhenFull, start_supervised_thread


def load_model_for(options: RunOptions, device: str | None = None, console: Console | None = None,
                   compile: bool | None = None) -> Any:
    """The model `options` name, prepared for the run's device and precision, as every command loads it
    (`run`, and `batch` once per worker). compile: as prepared_for_run takes it.

    Load the checkpoint; a known name not on this machine is downloaded first when the hub is reachable
    (the first run), else CheckpointError says which command fetches it and where to put it."""
    device = device or resolve_device(options.device)
    console = console or Console(stderr=True)
    checkpoint = options.checkpoint or DEFAULT_CHECKPOINT
    if checkpoint in KNOWN_CHECKPOINTS and not Path(checkpoint).exists() and locate_checkpoint(checkpoint) is None:
        if not hub_offline():
            # no spinner here: huggingface_hub draws its own progress bar
            announce = f"{checkpoint} is not on this machine yet: downloading it once (about {CHECKPOINT_SIZE})"
            checkpoint = str(download_checkpoint(checkpoint, on_start=lambda: console.print(announce)))
    # Read on the host; preparing puts each weight on the device once, in the precision the run
    # uses, so a bf16 run never holds a float32 copy of the transformer there.
    with console.status(f"loading {checkpoint} on {device}"):
        try:
            loaded = models.load_model(checkpoint, device="cpu")
        except (CheckpointError, OSError) as error:
            if swallowed_signal() is not None:
                # Ctrl-C or SIGTERM landed inside torch's reading, which turned its KeyboardInterrupt into a
                # ValueError ("could not determine the shape ..."): the user stopped the run, the file is fine
                raise KeyboardInterrupt from None
            if isinstance(error, CheckpointError):
                raise CheckpointError(checkpoint_advice(str(error))) from None
            raise CheckpointError(
                f"cannot read the checkpoint {error.filename or checkpoint}: {error.strerror or error}; "
                "check its permissions, or pass another --checkpoint"
            ) from None
        return prepared_for_run(loaded, options, device, compile=compile)


def model_config_for(options: RunOptions, model: Any = None) -> Any:
    """The ModelConfig a run will use, known before any weight is read: the given model's (None if it
    has none), the one a .safetensors file carries, else the official architecture (every .pt and
    known name has it)."""

    if model is not None:
        return getattr(model, "config", None)
    path = Path(options.checkpoint) if options.checkpoint else None
    if path is not None and path.is_file():
        check_readable(path)
        if path.suffix == ".safetensors":
            return checkpoint_config(path) or ModelConfig()
    return ModelConfig()


def check_readable(checkpoint: Path) -> None:
    """A checkpoint file this process may not read is said so (the loader would call it damaged)."""

    try:
        with open(checkpoint, "rb"):
            pass
    except OSError as error:
        raise CheckpointError(
            f"cannot read the checkpoint {checkpoint}: {error.strerror or error}; check its permissions, or pass "
            "another --checkpoint"
        ) from None


def prepared_for_run(model: Any, options: RunOptions, device: str, compile: bool | None = None) -> Any:
    """`model` made ready for this run's device and precision: a new model (`model` is left as it is),
    or a model prepared already, as it is. compile: whether to compile it (None: unless --compile off;
    a run that knows its input size decides with models.builds.plan.compile_choice)."""

    if getattr(model, "inference_spec", None) is not None:
        return model
    compile = options.compile != "off" if compile is None else compile
    try:
        return models.prepare_for_inference(model, device, resolve_dtype(options.dtype, device), compile=compile,
                                     artefacts=artefacts_dir())
    except ValueError as error:
        raise OptionsError(str(error)) from None


# The checkpoint's sha256 for run.json is a helper of the run: hashed on a thread (4.6 GB takes seconds the
# stream should not wait for); one that raises leaves run.json's digest empty, with one warning line and
# summary.helpers saying why.
DIGEST_POLICY = HelperPolicy("the checkpoint's digest", WhenFull.DROP, WhenDown.TURN_OFF, stall_s=60.0)


class CheckpointDigest:
    """sha256 of the checkpoint file for run.json, hashed on a supervised thread. A run without a checkpoint
    file (a caller's model) has none."""

    def __init__(self, checkpoint: str | None) -> None:
        self._digest: str | None = None
        self._thread: threading.Thread | None = None
        self.helper = Helper(DIGEST_POLICY)
        if checkpoint is not None:
            self._thread = start_supervised_thread(self.helper, lambda: self._compute(checkpoint), "digest")

    def _compute(self, checkpoint: str) -> None:
        self._digest = checkpoint_digest(resolve_checkpoint(checkpoint))

    def result(self, timeout_s: float = 60.0) -> str | None:
        """The digest; None when it failed or was not done within `timeout_s` (an interrupted run waits 1 s)."""
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self._digest

    def helpers(self) -> dict[str, Helper]:
        """The hashing thread, where one ran, by run.json's name."""
        return {} if self._thread is None else {"checkpoint_digest": self.helper}


def chunk_engine_config(options: RunOptions, model_config: Any) -> Any:
    """The settings each chunk's engine of a run streams with (what its compiled code depends on)."""

    return chunk_stream_config(StreamConfig(**options.stream_config_kwargs()), options.chunk_frames,
                               model_config.max_frames)


def build_engine(model: Any, options: RunOptions, device: str, dtype: Any, console: Console,
                 lookahead: bool | None = None) -> Any:
    """The streaming engine of a run around `model`, prepared already (load_model_for, prepared_for_run):
    a chunked one, for streams of any length. `lookahead`: ChunkedEngine's (None: where it helps and fits)."""

    config = StreamConfig(**options.stream_config_kwargs())
    # a stream shorter than one chunk runs exactly as a plain StreamingEngine would
    engine = ChunkedEngine(
        model, config, chunk_frames=options.chunk_frames,
        overlap=options.overlap, device=device, dtype=dtype, lookahead=lookahead,
    )
    fallback = auto_fallback_reason(device, dtype, options.kv_cache) if options.attention == "auto" else None
    engine.on_backend_ready = lambda name: announce_backend(name, fallback, console)
    engine.on_memory_plan = lambda plan: announce_memory_plan(plan, console)
    return engine


def check_gpu_memory(engine: Any, options: RunOptions, input_size: tuple[int, int] | None) -> None:
    """With --gpu-memory and a source whose frames' model input size (height, width) is known: the plan
    the engine would make at its first frame, made by the engine now, so that a budget nothing fits is
    refused before anything is written; a first frame of that size then uses it (the engine plans, and
    refuses, at its first frame for sources that only know their size once read, or whose frames come
    out another size)."""

    if options.gpu_memory is None or input_size is None:
        return
    try:
        engine.plan_memory_for(input_size)
    except MemoryBudgetError as error:
        raise OptionsError(str(error)) from None


def announce_memory_plan(plan: Any, console: Console) -> None:
    """What the budget made of the run, before its first frame; a warning when results change."""
    style = "yellow" if plan.changes_results else "default"
    console.print(f"[{style}]{plan.describe()}[/{style}]", highlight=False)


def announce_backend(name: str, fallback: str | None, console: Console) -> None:
    """The backend a run streams with over the paged K/V cache, what it is, why `auto` passed over the first of
    its order (`fallback`), and what its first use costs where the backend table says (FlashInfer's kernels
    compile then), rather than stall silently."""
    notes = [backend_summary(name), f"auto did not take its first choice: {fallback}" if fallback else "",
             first_use_note(name)]
    console.print(f"attention: {name} over the paged K/V cache" + "".join(f"; {note}" for note in notes if note),
                  highlight=False)
