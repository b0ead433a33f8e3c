"""A frame as a stream takes it: what was handed in checked once, before anything changes.

The engine checks each frame it is pushed (its first one then sets its size and caches up); a chunked stream
checks each frame here once and hands it, checked, to whichever of its engines takes it.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import FrameError


def checked_frame(image: torch.Tensor | np.ndarray, patch_size: int, stream_size: tuple[int, int] | None,
                  index: int) -> torch.Tensor:
    """The frame as a [3, H, W] tensor, uint8 or float (converted on the device); FrameError if it cannot be frame
    `index` of a stream whose frames are `stream_size` (height, width; None before its first frame)."""
    if isinstance(image, np.ndarray):
        image = torch.from_numpy(image)
    if not isinstance(image, torch.Tensor):
        raise FrameError(f"a frame must be a torch.Tensor or numpy array [3, H, W], got {type(image).__name__}")
    if image.ndim != 3 or image.shape[0] != 3:
        raise FrameError(f"a frame must have shape [3, H, W] (RGB, channels first), got {list(image.shape)}")
    if image.dtype != torch.uint8 and not image.is_floating_point():
        raise FrameError(f"a frame must be uint8 or float in [0, 1], got {image.dtype}")
    height, width = image.shape[1:]
    if height % patch_size or width % patch_size:
        raise FrameError(
            f"frame size {height}x{width} is not a multiple of the {patch_size}-pixel patch; preprocess it first "
            "(stream_recon.app.sources.preprocess)"
        )
    if stream_size is not None and (height, width) != stream_size:
        raise FrameError(
            f"frame {index} is {height}x{width} but the stream started at {stream_size[0]}x{stream_size[1]}; every "
            "frame of a stream must have one size"
        )
    return image if image.dtype == torch.uint8 else image.float()
