"""What a run is asked to do: RunOptions, checked once, and the device, precision and attention they resolve to.

The CLI (`run`, `batch`), presets (configs/*.yaml, app.presets) and the batch runner all build one
RunOptions; its field names are the preset keys and, with dashes, the flags. A bad value is an
OptionsError that names every problem at once, before anything is loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from stream_recon.app.preprocess import DEFAULT_IMAGE_WIDTH, PATCH_SIZE
from stream_recon.app.rundir import PredictionOutputs
from stream_recon.app.sources import DEFAULT_OPEN_TIMEOUT_S, DEFAULT_RECONNECT_S, FrameSelection
from stream_recon.cache import backends
from stream_recon.models.engine import KeyframePolicy

ATTENTION_CHOICES = backends.names()  # the backend table (stream_recon.cache.backends)
MAX_WINDOW_FRAMES = 1024  # positions in the model's temporal RoPE table
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
    # what each predictions/*.npz holds and which frames get one; defaults: rundir.PredictionOutputs'
    save_depth: str = PredictionOutputs.depth  # float16 | float32: depth and confidence
    save_images: bool = PredictionOutputs.images  # the model input image
    save_predictions: str = PredictionOutputs.frames  # all | keyframes
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
        for check in (self.selection, self.prediction_outputs):
            try:
                check()
            except ValueError as error:
                yield str(error)

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
        return kwargs

    def as_settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _is_keyframe_policy(text: str) -> bool:
    """Whether the engine would accept `text` as its keyframe policy (its own parser decides)."""
    try:
        KeyframePolicy.parse(text)
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------------------------
# What the options resolve to on this machine


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


def check_attention(attention: str, device: str, dtype: Any) -> None:
    """The attention backend must be able to run on this device in this precision (`auto` always
    can); the backend table (stream_recon.cache.backends) says why not and what to use instead."""
    try:
        backends.resolve(attention, device, dtype)
    except ValueError as error:
        raise OptionsError(str(error)) from None
