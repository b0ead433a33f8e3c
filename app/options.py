"""What a run is asked to do: RunOptions, checked once, and the device, precision and attention they resolve to.

The CLI (`run`, `batch`), presets (configs/*.yaml, app.run.presets) and the batch runner all build one
RunOptions; its field names are the preset keys and, with dashes, the flags. A bad value is an
OptionsError that names every problem at once, before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import math
import socket
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stream_recon.app.outputs.npz_schema import PredictionOutputs
from stream_recon.app.sources.input_size import DEFAULT_IMAGE_WIDTH, PATCH_SIZE
from stream_recon.app.sources.settings import (
    DEFAULT_OPEN_TIMEOUT_S,
    DEFAULT_RECONNECT_S,
    ROTATIONS,
    FrameSelection,
)
from stream_recon.models import (
    EVEN_ODDS_CONFIDENCE,
    SCALE_FRAMES,
    TRAINED_VIEWS,
    WINDOW,
    keyframe_spellings,
    parse_keyframes,
    parse_memory_size,
)
from stream_recon.models.attention_backends import backend_names, resolve_backend, unknown_backend_advice

KV_CACHE_CHOICES = ("auto", "fp8")  # auto: the model's precision (models.attention_backends.resolve_backend)
# auto: on when the pose graph's library is installed and the stream can reach a third chunk (a loop joins
# chunks two or more apart; app.run.loops); on: the same, and a missing library is an error; off: never.
LOOP_CLOSURE_CHOICES = ("auto", "on", "off")
# auto: where the first streaming step compiles or records a CUDA graph (the engine's slow_first_step: CUDA
# by default), that step runs on copies of the first frame before the stream; on: everywhere; off: never.
WARM_UP_CHOICES = ("auto", "on", "off")
# auto: on CUDA, compiled where this machine's compile caches hold the run's input size; where they do not, the run streams uncompiled and a child process compiles that size
# beside it for the next run (models/builds/plan.py); on: compiled before the stream, whatever it costs; off: never.
COMPILE_CHOICES = ("auto", "on", "off")
# What the viewer draws for a keyframe: its points, or a Gaussian splat per point (app.outputs.splats' opacity rule)
SHOW_CHOICES = ("points", "splats")
# The options that take one of a few words, by field, in the order their problems are named
WORD_CHOICES = {"loop_closure": LOOP_CLOSURE_CHOICES, "compile": COMPILE_CHOICES, "warm_up": WARM_UP_CHOICES,
                "kv_cache": KV_CACHE_CHOICES, "show": SHOW_CHOICES}
# points.ply (and exports) keep the pixels whose depth the model is more sure of than not
DEFAULT_CONF_THRESHOLD = EVEN_ODDS_CONFIDENCE
# The live viewer's address: this machine only (viser's own default host is every interface)
VIEWER_HOST = "127.0.0.1"
VIEWER_PORT = 8080
MAX_CHUNK_FRAMES = 1024  # positions in the model's temporal RoPE table
# The released models' camera head refines its poses four times (ModelConfig.camera_iterations); a run may
# stop earlier, never go further than the head was trained to.
MAX_CAMERA_ITERATIONS = 4
DTYPE_NAMES = {"auto": None, "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16",
               "bf16": "bfloat16", "float16": "float16", "fp16": "float16"}


# The fields whose value changes what a run writes (predictions, cloud), as opposed to where, how fast
# or how visibly it runs: a batch compares them to decide whether a finished sequence still stands.
RESULT_FIELDS = (
    "checkpoint", "dtype", "kv_cache", "gpu_memory", "scale_frames", "window", "chunk_frames", "overlap",
    "keyframes", "flow_threshold", "max_gap", "loop_closure", "extend_map", "camera_iterations", "rotate", "image_width", "mask_sky", "mask_dir", "fps", "max_frames", "start", "stride", "conf_threshold", "voxel_size",
)


# Flags spelled otherwise than their field's name with dashes (`scale_frames` is --scale-frames).
FLAG_NAMES = {"checkpoint": ("--checkpoint", "-c"), "open_timeout_s": ("--open-timeout",),
              "reconnect_s": ("--reconnect",), "extend_map": ("--map",), "chunk_frames": ("--chunk-frames", "--window-frames")}


def flag(field: str) -> str:
    """The flag of a RunOptions field, as messages name it: what the user typed, not the field."""
    return FLAG_NAMES.get(field, (f"--{field.replace('_', '-')}",))[0]


class PresetError(ValueError):
    """A preset (app/run/presets.py) that cannot be found, parsed, or names options that do not exist."""


class OptionsError(ValueError):
    """Run options that are out of range or do not fit this machine (e.g. CUDA asked for, none here)."""


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """Everything a run needs besides the source and the output folder. Defaults are the reference's.

    The CLI, presets (configs/*.yaml) and the batch runner all build one of these; field names are
    the preset keys.
    """

    # model
    checkpoint: str | None = None  # path or known name; None: models.checkpoint_names.DEFAULT_CHECKPOINT
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 transformer on CUDA, fp32 on CPU) | float32 | bfloat16 | float16
    attention: str = "auto"  # a name of the backend table (models.attention_backends.backend_names)
    compile: str = "auto"  # auto | on | off: torch.compile the blocks and heads (CUDA only)
    warm_up: str = "auto"  # auto | on | off: compile and record the streaming step before the first frame
    memory_check: bool = True  # refuse a CPU run whose memory estimate exceeds what is available (app.run.resources)
    kv_cache: str = "auto"  # K/V cache precision: auto (the model's) | fp8 (e4m3, a scale per token and head)
    gpu_memory: str | None = None  # a device-memory budget such as "8GiB": the engine plans to fit it (models.stream.memory)
    # engine
    scale_frames: int = SCALE_FRAMES
    window: int = WINDOW
    # long streams: a new chunk (fresh cache, aligned by Sim(3) on `overlap` shared frames) starts
    # before the cache holds more than `chunk_frames` frames, the range the model was trained on
    chunk_frames: int = TRAINED_VIEWS
    overlap: int = 16
    keyframes: str = "all"  # a spelling of a policy of models/stream/keyframes/ (a file each)
    flow_threshold: float | None = None  # None: the engine's default
    max_gap: int | None = None  # flow policy: longest run of non-keyframes; None: engine default
    loop_closure: str = "auto"  # auto | on | off: the pose graph over chunks corrects drift at revisits
    extend_map: str | None = None  # an earlier run whose map this stream is placed in (read, never written)
    camera_iterations: int | None = None  # the camera head's refinement iterations; None: all (4)
    image_width: int = DEFAULT_IMAGE_WIDTH
    # source
    fps: float | None = None
    max_frames: int | None = None
    start: int = 0
    stride: int = 1
    open_timeout_s: float = DEFAULT_OPEN_TIMEOUT_S
    reconnect_s: float = DEFAULT_RECONNECT_S  # a live source that drops is retried this long; 0: never
    rotate: int = 0  # degrees clockwise each frame is turned before the model: 0, 90, 180 or 270
    # outputs
    conf_threshold: float = DEFAULT_CONF_THRESHOLD
    voxel_size: float | None = None  # None: automatic, relative to the first frame's depth
    mask_sky: bool = False  # leave the sky out of every point (app.outputs.sky's network; the npz keep the mask)
    mask_dir: str | None = None  # a folder of one mask per frame, 0 = leave the pixel out (app.outputs.masks)
    overwrite: bool = False
    # what each predictions/*.npz holds and which frames get one; defaults: rundir.PredictionOutputs'
    save_depth: str = PredictionOutputs.depth  # float16 | float32: depth and confidence
    save_images: bool = PredictionOutputs.images  # the model input image
    save_predictions: str = PredictionOutputs.frames  # all | keyframes
    # live viewer
    viewer: bool = True
    host: str = VIEWER_HOST
    port: int = VIEWER_PORT
    keep_viewer: bool = False  # after the run, keep serving the result until Ctrl-C
    show: str = "points"  # points | splats: what the viewer draws for each keyframe

    def __post_init__(self) -> None:
        for field, choices in WORD_CHOICES.items():
            value = getattr(self, field)
            # YAML reads a preset's on/off (and true/false, yes/no) as booleans; an earlier run's settings
            # may hold `compile: true`
            if isinstance(value, bool) and "on" in choices:
                object.__setattr__(self, field, "on" if value else "off")
        problems = list(self._problems())
        if problems:
            raise OptionsError("; ".join(problems))

    def _problems(self) -> Iterator[str]:
        wrong_types = list(_type_problems(self))
        if wrong_types:  # the range checks below would compare a string with a number
            yield from wrong_types
            return
        if self.dtype not in DTYPE_NAMES:
            yield f"--dtype must be one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}"
        if self.scale_frames < 1:
            yield f"--scale-frames must be >= 1, got {self.scale_frames}"
        if self.window < 1:
            yield f"--window must be >= 1, got {self.window}"
        least_chunk = max(2, self.scale_frames + 1)  # a chunk holds its scale frames and at least one more
        if self.chunk_frames < 2:
            yield (f"--chunk-frames must be >= {least_chunk} (more than --scale-frames, {self.scale_frames}), "
                   f"got {self.chunk_frames}")
        elif self.scale_frames >= self.chunk_frames:
            yield self._scale_frames_beyond_a_chunk()
        elif self.chunk_frames > MAX_CHUNK_FRAMES:
            yield (
                f"--chunk-frames must be at most {MAX_CHUNK_FRAMES} (the model's temporal position table), "
                f"got {self.chunk_frames}"
            )
        elif not 1 <= self.overlap < self.chunk_frames:
            yield self._overlap_beyond_a_chunk()
        if self.image_width <= 0 or self.image_width % PATCH_SIZE:
            yield f"--image-width must be a positive multiple of {PATCH_SIZE}, got {self.image_width}"
        if self.flow_threshold is not None and not _positive(self.flow_threshold):
            yield f"--flow-threshold must be a number > 0, got {self.flow_threshold}"
        if self.max_gap is not None and self.max_gap < 1:
            yield f"--max-gap must be >= 1, got {self.max_gap}"
        if self.rotate not in ROTATIONS:
            yield f"--rotate must be one of {', '.join(map(str, ROTATIONS))} (degrees clockwise), got {self.rotate}"
        if self.camera_iterations is not None and not 1 <= self.camera_iterations <= MAX_CAMERA_ITERATIONS:
            yield (f"--camera-iterations must be between 1 and {MAX_CAMERA_ITERATIONS} (the camera head's refinement "
                   f"iterations), got {self.camera_iterations}")
        if not _positive(self.open_timeout_s):
            yield f"--open-timeout must be a number of seconds > 0, got {self.open_timeout_s}"
        if not (math.isfinite(self.reconnect_s) and self.reconnect_s >= 0):
            yield f"--reconnect must be a number of seconds >= 0 (0: never reconnect), got {self.reconnect_s}"
        yield from point_cloud_problems(self.conf_threshold, self.voxel_size)
        for field, choices in WORD_CHOICES.items():
            value = getattr(self, field)
            if value not in choices:
                yield f"{flag(field)} must be one of {', '.join(choices)}, got {value!r}"
        port_problem = viewer_port_problem(self.port)
        if port_problem:
            yield port_problem
        for check in (self.selection, self.prediction_outputs):
            try:
                check()
            except ValueError as error:
                yield str(error)
        yield from _engine_problems(self)

    def _scale_frames_beyond_a_chunk(self) -> str:
        """The scale frames do not leave a chunk room for another frame, said of the flag the user changed:
        --chunk-frames when only it differs from its default (`--chunk-frames 5` beside the default 8 scale
        frames), else --scale-frames."""
        why = "the scale frames stay in the cache of every chunk"
        if self.chunk_frames != RunOptions.chunk_frames and self.scale_frames == RunOptions.scale_frames:
            return (f"--chunk-frames ({self.chunk_frames}) must be more than --scale-frames ({self.scale_frames}): "
                    f"{why}; raise --chunk-frames (at most {MAX_CHUNK_FRAMES}) or lower --scale-frames")
        return (f"--scale-frames ({self.scale_frames}) must be less than --chunk-frames ({self.chunk_frames}): "
                f"{why}; lower --scale-frames or raise --chunk-frames (at most {MAX_CHUNK_FRAMES})")

    def _overlap_beyond_a_chunk(self) -> str:
        """--overlap out of a chunk's range, said as the default it is when only --chunk-frames was typed
        (`--chunk-frames 9` beside the default overlap of 16)."""
        said = f"--overlap must be between 1 and --chunk-frames - 1 ({self.chunk_frames - 1}), got {self.overlap}"
        if self.overlap == RunOptions.overlap and 1 < self.chunk_frames:
            said += (f", its default: with --chunk-frames {self.chunk_frames} give a smaller --overlap too (say "
                     f"--overlap {max(1, self.chunk_frames // 4)})")
        return said

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    def prediction_outputs(self) -> PredictionOutputs:
        return PredictionOutputs(depth=self.save_depth, images=self.save_images, frames=self.save_predictions)

    def selection(self) -> FrameSelection:
        return FrameSelection(start=self.start, stride=self.stride, fps=self.fps, max_frames=self.max_frames)

    def stream_config_kwargs(self) -> dict[str, Any]:
        """StreamConfig arguments; unset optional values are left to the engine's defaults."""
        kwargs: dict[str, Any] = dict(
            scale_frames=self.scale_frames, window=self.window, keyframes=self.keyframes, attention=self.attention,
        )
        if self.flow_threshold is not None:
            kwargs["flow_threshold"] = self.flow_threshold
        if self.max_gap is not None:
            kwargs["max_gap"] = self.max_gap
        kwargs["kv_cache"] = self.kv_cache
        if self.camera_iterations is not None:
            kwargs["camera_iterations"] = self.camera_iterations
        if self.gpu_memory is not None:
            kwargs["gpu_memory"] = parse_memory_size(self.gpu_memory)
        return kwargs

    def as_settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def result_settings(self) -> dict[str, Any]:
        """The options that change a run's results (RESULT_FIELDS), as given."""
        return {name: getattr(self, name) for name in RESULT_FIELDS}


# Options under an earlier name, as presets and the settings of earlier runs may spell them.
RENAMED_OPTIONS = {"window_frames": "chunk_frames"}


def current_names(values: dict[str, Any]) -> dict[str, Any]:
    """`values` with every option under its current name (RENAMED_OPTIONS)."""
    return {RENAMED_OPTIONS.get(name, name): value for name, value in values.items()}


def changed_settings(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`name old -> new` for each result setting that differs (a setting `before` lacks counts as its default)."""
    defaults = RunOptions().result_settings()
    before = current_names(before)
    changes = []
    for name, value in now.items():
        old = before.get(name, defaults.get(name))
        if old != value:
            changes.append(f"{name} {old} -> {value}")
    return changes


def point_cloud_problems(conf_threshold: float | None, voxel_size: float | None) -> Iterator[str]:
    """What is wrong with a point cloud's filter (a run's, or an export's; None: not given).

    Confidence is 1 + exp(logit), always above 1: a threshold of 1 keeps every pixel, and one below
    1 would only look stricter than it is, so it is refused rather than read as 1.
    """
    if conf_threshold is not None and not (math.isfinite(conf_threshold) and conf_threshold >= 1):
        yield f"--conf-threshold must be a number >= 1 (confidence is 1 + exp(logit); 1 keeps every pixel), got {conf_threshold}"
    if voxel_size is not None and not _positive(voxel_size):
        yield f"--voxel-size must be a number > 0 in scene units (leave it out for the automatic size), got {voxel_size}"


def _positive(value: float) -> bool:
    """A finite number above zero (NaN and infinity are not sizes or durations)."""
    return math.isfinite(value) and value > 0


def _type_problems(options: RunOptions) -> Iterator[str]:
    """Values of the wrong kind, as a preset file can hold them (`window: "64"`, `fps: [10]`)."""
    hints = typing.get_type_hints(RunOptions)
    for field in dataclasses.fields(options):
        value = getattr(options, field.name)
        kinds = typing.get_args(hints[field.name]) or (hints[field.name],)
        if value is None and type(None) in kinds:
            continue
        if float in kinds and isinstance(value, int) and not isinstance(value, bool):
            continue  # `fps: 10` in YAML is a float option's int
        if not any(kind is not type(None) and _is_of(value, kind) for kind in kinds):
            wanted = " or ".join(_KIND_NAMES[kind] for kind in kinds)
            yield f"{flag(field.name)} ({field.name} in a preset) must be {wanted}, got {value!r}"


# bool is an int in Python; an option that takes a number does not take true/false
_KIND_NAMES = {int: "an integer", float: "a number", str: "text", bool: "true or false", type(None): "unset"}


def _is_of(value: Any, kind: type) -> bool:
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, kind)


def _engine_problems(options: RunOptions) -> Iterator[str]:
    """What the engine's own tables refuse: the attention backend's name, the keyframe policy, the memory
    budget's spelling. Each is read from a torch-free module of the engine's (the backends' names, the
    policies' spellings, the size parser), so that a bad value is answered before torch is imported."""
    if options.attention not in backend_names():
        yield unknown_backend_advice(options.attention)
    try:
        parse_keyframes(options.keyframes)
    except ValueError:
        yield f"--keyframes must be {keyframe_spellings()}, got {options.keyframes!r}"
    if options.gpu_memory is not None:
        try:
            parse_memory_size(options.gpu_memory)
        except ValueError as error:
            yield f"--gpu-memory: {error}"


# ----------------------------------------------------------------------------------------------
# What the options resolve to on this machine


def resolve_device(device: str) -> str:
    """`auto` -> cuda when available, else cpu. An unavailable CUDA is an error, not a silent CPU run."""
    # torch: resolved when a command runs, never when -h reads the flags
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
        raise OptionsError(f"--device must be auto, cpu, cuda or cuda:N, got {device!r}")
    return device


def resolve_dtype(name: str, device: str) -> Any:
    """`auto`: bf16 on CUDA (fp16 before Ampere, which has no fast bf16), fp32 on CPU, as the reference."""
    # torch: resolved when a command runs, never when -h reads the flags
    import torch

    canonical = DTYPE_NAMES[name]
    if canonical is not None:
        return getattr(torch, canonical)
    if not device.startswith("cuda"):
        return torch.float32
    major, _ = torch.cuda.get_device_capability(device)
    return torch.bfloat16 if major >= 8 else torch.float16


def check_attention(attention: str, device: str, dtype: Any, kv_cache: str = "auto") -> str:
    """The attention backend must be able to run on this device in this precision, over a cache
    stored as `kv_cache` asks (`auto` always can); the backend table (models.attention_backends)
    says why not and what to use instead. Returns the name of the backend the run will use."""
    try:
        return resolve_backend(attention, device, dtype, kv_cache)
    except ValueError as error:
        raise OptionsError(str(error)) from None


def viewer_port_problem(port: int) -> str | None:
    """What is wrong with a viewer's --port (`run`'s, `view`'s), or None."""
    return None if 0 < port < 65536 else f"--port must be between 1 and 65535, got {port}"


def check_viewer_address(host: str, port: int, *, optional: bool = True) -> None:
    """The viewer's address must be one of this machine's (checked before the model loads; viser
    would only fail after it), its port one there is. A port in use is fine: the viewer takes the
    next free one. optional: the command can run without its viewer (`run --no-viewer`; `view` cannot)."""

    port_problem = viewer_port_problem(port)
    if port_problem:
        raise OptionsError(port_problem)

    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, protocol) as probe:
            probe.bind(address)
    except OSError as error:
        reason = getattr(error, "strerror", None) or error
        alternatives = "an address of this machine, or --no-viewer" if optional else "or an address of this machine"
        raise OptionsError(
            f"the viewer cannot serve on {host}:{port} ({reason}): use --host {VIEWER_HOST} (this machine only), "
            f"{alternatives}"
        ) from None
