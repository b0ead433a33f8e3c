"""Sky segmentation with the reference demo's network (`skyseg.onnx`, Hugging Face JianyuanWang/skyseg), run
with onnxruntime: where it is on this machine, its download, and a frame's sky pixels.

The arithmetic is the reference's, step for step, so that the masks are the same pixel for pixel:
- the RGB frame resized to 320 x 320 (OpenCV, bilinear), scaled to [0, 1] and ImageNet-normalised, [1, 3, 320, 320];
- the network's score map (higher on sky) min-max normalised to 0..255 and truncated to uint8;
- that map resized back to the frame (bilinear, uint8), inverted into a non-sky confidence 1 - min(v, 1)
  and kept where it exceeds 0.1. On the integer map that is "v == 0": a pixel is kept only where the score
  lands on the map's floor, within 1/255 of its range above the least sky-like pixel.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cv2
import numpy as np
from huggingface_hub import hf_hub_download, try_to_load_from_cache
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

from stream_recon.models.hub_paths import (
    checkpoint_dir,
    hub_cache_dir,
    hub_endpoint,
    hub_offline,
    hub_unreachable,
)

SKYSEG_REPO_ID = "JianyuanWang/skyseg"
SKYSEG_FILE = "skyseg.onnx"
SKYSEG_URL = f"https://huggingface.co/{SKYSEG_REPO_ID}/resolve/main/{SKYSEG_FILE}"
# The network's input, width and height
SKYSEG_INPUT_SIZE = (320, 320)
IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)
# The non-sky confidence a pixel must exceed to be kept (the reference's soft threshold)
NON_SKY_THRESHOLD = 0.1
# onnxruntime's providers, fastest first: the GPU build's CUDA provider where it is installed
PREFERRED_PROVIDERS = ("CUDAExecutionProvider", "CPUExecutionProvider")
# The CUDA provider's convolutions in the channels-last layout its tensor-core kernels take: the sky network
# shares the GPU with the stream, and every millisecond it holds the GPU comes off the stream's frames.
PROVIDER_OPTIONS = {"CUDAExecutionProvider": {"prefer_nhwc": "1"}}
# On the GPU the network's kernels go to a stream confined to this many SMs (a green context, where the
# driver makes one; None: the CUDA provider's own stream on the whole GPU). Spread over every SM, its blocks
# fill the device between the stream's kernels, and each kernel of the stream then waits for them to drain.
# Steady FPS beside a float32 network, of the plain run's: 0.963 on 32 SMs, 0.957 on all 132, 0.944 on 16.
SKY_NETWORK_SMS: int | None = 32
# On the GPU the network's weights and arithmetic are float16 (its input and output stay float32): beside the
# stream at 518x392 a float32 network cost 3.7 % of the steady FPS and a float16 one 1.7 % (the stand-in of
# its cost, scripts/device/measure.sh sky). A pixel's verdict moves only where its score lies within float16's
# rounding of the 1/255-of-the-range threshold.
HALF_PRECISION_ON_GPU = True


class SkyModelError(ValueError):
    """The sky network is missing, cannot be fetched, or cannot be run here (one sentence: what to do)."""


class SkyNetworkUnavailable(SkyModelError):
    """skyseg.onnx is not on this machine and cannot be fetched: Hugging Face offline mode, or the hub unreachable
    (`download` exits as a run does for the same cause: bad input, exit 2)."""


# A checkout (an editable install) has scripts/setup-env beside the package's folders: the sky extra is installed
# with it there; `stream-recon[sky]` is no package name on PyPI.
_SETUP_ENV = Path(__file__).resolve().parents[2] / "scripts" / "setup-env"


def sky_extra_advice() -> str:
    """How to install what the sky network runs on (onnxruntime, and onnx for float16 on the GPU)."""
    if _SETUP_ENV.is_file():
        return (f"run `{_SETUP_ENV} sky` (onnxruntime and onnx; on a GPU machine pip install onnxruntime-gpu into "
                "its .venv for the CUDA provider)")
    return "pip install onnxruntime onnx (onnxruntime-gpu instead on a GPU machine)"


def onnxruntime_problem() -> str | None:
    """Why onnxruntime does not import here ("is not installed here", or its own error), None when it does."""
    return _onnxruntime()[1]


def _onnxruntime() -> tuple[Any, str | None]:
    """onnxruntime, imported; or None and why it does not import here."""
    try:
        import onnxruntime  # the optional `sky` extra: imported only for --mask-sky and by `info`
    except ImportError as error:
        if error.name == "onnxruntime":
            return None, "is not installed here"
        return None, f"does not import here ({type(error).__name__}: {error})"
    return onnxruntime, None


def skyseg_folder() -> Path:
    """Where `stream-recon download skyseg` puts the network and runs look for it: the checkpoints' folder."""

    return checkpoint_dir()


def locate_skyseg() -> Path | None:
    """skyseg.onnx in the checkpoints' folder, else in the Hugging Face cache; None when it is in neither."""
    own = skyseg_folder() / SKYSEG_FILE
    if own.is_file():
        return own
    cached = try_to_load_from_cache(SKYSEG_REPO_ID, SKYSEG_FILE, cache_dir=hub_cache_dir())
    return Path(cached) if isinstance(cached, str) else None


def _fetch_by_hand() -> str:
    return f"fetch {SKYSEG_URL} on a machine with network access and put it in {skyseg_folder()}"


def download_skyseg() -> Path:
    """The network fetched into the Hugging Face cache (a no-op when it is there); SkyNetworkUnavailable at once
    when the hub is off or cannot be reached, SkyModelError when the download fails after the hub answered,
    each naming the URL and the folder to put the file in."""
    unavailable = _hub_unavailable()
    if unavailable is not None:
        raise SkyNetworkUnavailable(f"cannot download {SKYSEG_FILE} ({unavailable}); {_fetch_by_hand()}")
    reason = _download()
    if isinstance(reason, Path):
        return reason
    raise SkyModelError(f"cannot download {SKYSEG_FILE} ({reason}); {_fetch_by_hand()}")


def _hub_unavailable() -> str | None:
    """Why the hub cannot give the file now (offline mode, or no answer to one request), None when it answers.
    One request without retries: huggingface_hub's download retries an unreachable hub for about 25 s."""
    if hub_offline():
        return "Hugging Face offline mode is on: HF_HUB_OFFLINE"
    endpoint = hub_endpoint()
    error = hub_unreachable(f"{endpoint}/{SKYSEG_REPO_ID}/resolve/main/{SKYSEG_FILE}")
    if error is None:
        return None
    detail = str(error).strip().splitlines()[0] if str(error).strip() else "no detail"
    return f"the Hugging Face hub at {endpoint} cannot be reached: {type(error).__name__}: {detail}"


def _download() -> Path | str:
    """The downloaded file, or why it could not be downloaded (the hub answered)."""
    try:
        return Path(hf_hub_download(SKYSEG_REPO_ID, SKYSEG_FILE, cache_dir=hub_cache_dir(), endpoint=hub_endpoint()))
    except (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled, OSError) as error:
        return str(error).splitlines()[0] if str(error) else type(error).__name__


def sky_network_path(download: bool) -> Path:
    """The sky network on this machine, ready to run: skyseg.onnx (fetched first when `download`, it is missing
    and onnxruntime imports) and onnxruntime. SkyModelError names every part that is missing at once, and
    what to do for each: SkyNetworkUnavailable where the file alone is missing and cannot be fetched."""
    runtime = onnxruntime_problem()
    found = locate_skyseg()
    if runtime is not None:
        missing = "" if found is not None else (
            f", and {SKYSEG_FILE}, which is not on this machine either: run `stream-recon download skyseg`, or "
            f"{_fetch_by_hand()}")
        raise SkyModelError(f"--mask-sky runs the sky network with onnxruntime, which {runtime}: "
                            f"{sky_extra_advice()}{missing}")
    if found is not None:
        return found
    if not download:
        raise SkyModelError(f"--mask-sky needs {SKYSEG_FILE}, which is not on this machine: run `stream-recon "
                            f"download skyseg`, or {_fetch_by_hand()}")
    unavailable = _hub_unavailable()
    if unavailable is not None:
        raise SkyNetworkUnavailable(f"--mask-sky needs {SKYSEG_FILE}, which is not on this machine and cannot be "
                                    f"downloaded ({unavailable}); {_fetch_by_hand()}")
    reason = _download()
    if isinstance(reason, Path):
        return reason
    raise SkyModelError(f"--mask-sky needs {SKYSEG_FILE}, which is not on this machine and cannot be downloaded "
                        f"({reason}); {_fetch_by_hand()}")


class SkySegmenter:
    """One onnxruntime session of the sky network; `sky_pixels` may be called from several threads at once
    (onnxruntime's run is thread-safe). `compute_stream`: a CUDA stream's handle for the CUDA provider's
    kernels (None: the provider makes its own); `half_precision`: the network in float16 (None: on the GPU,
    as HALF_PRECISION_ON_GPU says)."""

    def __init__(self, model_path: Path | str, compute_stream: int | None = None,
                 half_precision: bool | None = None) -> None:
        onnxruntime, problem = _onnxruntime()
        if problem is not None:
            raise SkyModelError(f"--mask-sky runs the sky network with onnxruntime, which {problem}: "
                                f"{sky_extra_advice()}")
        available = set(onnxruntime.get_available_providers())
        providers = [name for name in PREFERRED_PROVIDERS if name in available]
        options = {name: dict(PROVIDER_OPTIONS.get(name, {})) for name in providers}
        on_gpu = "CUDAExecutionProvider" in options
        if compute_stream is not None and on_gpu:
            options["CUDAExecutionProvider"].update(user_compute_stream=str(compute_stream), has_user_compute_stream="1")
        self.half_precision = HALF_PRECISION_ON_GPU and on_gpu if half_precision is None else half_precision
        try:
            model = _half_precision_model(model_path) if self.half_precision else str(model_path)
            self.session: Any = onnxruntime.InferenceSession(
                model, providers=providers, provider_options=[options[name] for name in providers])
        except SkyModelError:
            raise
        except Exception as error:  # onnx and onnxruntime raise their own types for a damaged or foreign file
            raise SkyModelError(f"cannot load the sky network {model_path}: {str(error).splitlines()[0]}; "
                                f"{_fetch_by_hand()} again") from None
        self.input_name = self.session.get_inputs()[0].name
        self.output_name = self.session.get_outputs()[0].name
        self.provider = self.session.get_providers()[0]

    def score_map(self, rgb: np.ndarray) -> np.ndarray:
        """[H, W, 3] uint8 RGB -> the network's sky score map, min-max normalised to uint8 [320, 320]."""
        small = cv2.resize(rgb, SKYSEG_INPUT_SIZE)  # per channel: the same as resizing its BGR copy
        x = (small.astype(np.float32) / 255.0 - IMAGENET_MEAN) / IMAGENET_STD
        x = x.transpose(2, 0, 1)[None].astype(np.float32)  # [1, 3, 320, 320]
        scores = np.asarray(self.session.run([self.output_name], {self.input_name: x})).squeeze()
        low, high = np.min(scores), np.max(scores)
        scores = (scores - low) / max(high - low, 1e-8)
        scores *= 255.0
        return scores.astype(np.uint8)

    def sky_pixels(self, rgb: np.ndarray) -> np.ndarray:
        """[H, W, 3] uint8 RGB -> bool [H, W], True where the pixel is sky (see the module docstring)."""
        height, width = rgb.shape[:2]
        scores = cv2.resize(self.score_map(rgb), (width, height), interpolation=cv2.INTER_LINEAR)
        non_sky = 1.0 - np.clip(scores.astype(np.float32), 0.0, 1.0)
        return non_sky <= NON_SKY_THRESHOLD


def _half_precision_model(model_path: Path | str) -> bytes:
    """The network with float16 weights and arithmetic behind float32 input and output, serialised."""
    try:
        import onnx  # the `sky` extra, read only where the network runs in float16
        from onnxruntime.transformers.float16 import convert_float_to_float16
    except ImportError as error:
        raise SkyModelError(f"--mask-sky on the GPU runs the sky network in float16, which needs {error.name}: "
                            f"{sky_extra_advice()}") from None
    return convert_float_to_float16(onnx.load(str(model_path)), keep_io_types=True).SerializeToString()
