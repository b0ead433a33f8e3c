"""Moving a step's data between the host and the device: frames up, predictions down.

Down: a step's float outputs are packed on the device into one float32 tensor per step, [S, N]
(cameras decoded there), and copied with the frames' uint8 images into reused pinned buffers,
asynchronously; the host waits for one event when it needs the values. Up: a frame is copied
into a pinned buffer and sent asynchronously; the conversion to float happens on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .pose import decode_pose


def packed_fields(height: int, width: int, descriptor_dim: int = 0) -> dict[str, tuple[int, ...]]:
    """The packed layout of one frame's float outputs: name -> shape, in this order (the loop-retrieval
    descriptor last, when the step computes one)."""
    fields = {"pose_enc": (9,), "c2w": (3, 4), "intrinsics": (3, 3), "depth": (height, width),
              "depth_conf": (height, width)}
    return {**fields, "descriptor": (descriptor_dim,)} if descriptor_dim else fields


def pack_outputs(outputs: dict[str, torch.Tensor], height: int, width: int) -> torch.Tensor:
    """A step's outputs (pose_enc [S, 9], depth and depth_conf [S, H, W], descriptor [S, C] if any) as
    one float32 tensor [S, 30 + 2HW (+ C)] in `packed_fields` order, the cameras decoded on the device."""
    pose_enc = outputs["pose_enc"].float()
    c2w, intrinsics = decode_pose(pose_enc, height, width)
    fields = (pose_enc, c2w, intrinsics, outputs["depth"].float(), outputs["depth_conf"].float())
    if "descriptor" in outputs:
        fields += (outputs["descriptor"].float(),)
    return torch.cat([t.reshape(len(pose_enc), -1) for t in fields], dim=1)


def unpack_outputs(packed: np.ndarray, height: int, width: int) -> dict[str, np.ndarray]:
    """[S, N] float32 -> name -> [S, *shape] arrays (views of `packed`); a descriptor is whatever follows
    the per-pixel fields."""
    unpacked, start = {}, 0
    descriptor_dim = packed.shape[1] - sum(int(np.prod(shape)) for shape in packed_fields(height, width).values())
    for name, shape in packed_fields(height, width, descriptor_dim).items():
        size = int(np.prod(shape))
        unpacked[name] = packed[:, start : start + size].reshape(len(packed), *shape)
        start += size
    return unpacked


def quantize(images: torch.Tensor) -> torch.Tensor:
    """[S, 3, H, W] floats in [0, 1] -> [S, H, W, 3] uint8, the image a prediction refers to."""
    return (images.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)


@dataclass
class Staged:
    """One step's outputs on their way to the host: `copied` completes when both buffers hold them."""

    packed: torch.Tensor  # [S, N] float32, pinned
    rgb: torch.Tensor  # [S, H, W, 3] uint8, pinned
    copied: torch.cuda.Event | None
    height: int
    width: int
    keep_alive: tuple = ()  # device tensors the copies read: alive until the copies ran


class HostStaging:
    """Pinned host buffers for predictions, reused: a buffer pair returns to the pool once the host
    has read it (`receive`), so a pipelined stream with one frame in flight uses two pairs."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def send(self, packed: torch.Tensor, rgb: torch.Tensor, height: int, width: int) -> Staged:
        """Enqueue the copies of packed [S, N] and rgb [S, H, W, 3] on the current stream."""
        if self.device.type != "cuda":
            return Staged(packed, rgb, None, height, width)
        key = (tuple(packed.shape), tuple(rgb.shape))
        pool = self._free.setdefault(key, [])
        host_packed, host_rgb = pool.pop() if pool else (torch.empty(packed.shape, pin_memory=True),
                                                        torch.empty(rgb.shape, dtype=torch.uint8, pin_memory=True))
        host_packed.copy_(packed, non_blocking=True)
        host_rgb.copy_(rgb, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return Staged(host_packed, host_rgb, copied, height, width, keep_alive=(packed, rgb))

    def receive(self, staged: Staged) -> dict[str, np.ndarray]:
        """Wait for the copies; the outputs as arrays of their own ([S, ...] each, plus `image`)."""
        if staged.copied is None:
            return {**unpack_outputs(staged.packed.numpy(), staged.height, staged.width), "image": staged.rgb.numpy()}
        staged.copied.synchronize()
        host = {**unpack_outputs(staged.packed.numpy().copy(), staged.height, staged.width),
                "image": staged.rgb.numpy().copy()}
        key = (tuple(staged.packed.shape), tuple(staged.rgb.shape))
        self._free.setdefault(key, []).append((staged.packed, staged.rgb))
        staged.keep_alive = ()
        return host


class FrameUpload:
    """Frames to the device: a reused pinned buffer per frame size and dtype, an asynchronous copy,
    and the conversion to float on the device (a uint8 frame crosses the bus at a quarter of the
    bytes of a float one). On the CPU, a plain conversion."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pinned: dict[tuple, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None

    def send(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """images [S, 3, H, W] uint8, or float in [0, 1] -> (float [S, 3, H, W] on the device,
        uint8 [S, H, W, 3] on the device: the image the prediction carries)."""
        if self.device.type == "cuda" and images.device.type == "cpu":
            images = self._to_device(images)
        else:
            images = images.to(self.device)
        if images.dtype == torch.uint8:
            return images.float() / 255, images.permute(0, 2, 3, 1)
        return images.float(), quantize(images)

    def _to_device(self, images: torch.Tensor) -> torch.Tensor:
        key = (tuple(images.shape), images.dtype)
        if key not in self._pinned:
            self._pinned[key] = torch.empty(images.shape, dtype=images.dtype, pin_memory=True)
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffer is free again once its last copy ran
        staging = self._pinned[key]
        staging.copy_(images)
        on_device = staging.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return on_device
