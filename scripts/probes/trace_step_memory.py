"""Peak activation bytes of one model step, traced on the meta device (no GPU, no arithmetic).

    python scripts/probes/trace_step_memory.py                       # 518x378, the scale frames and a streaming frame
    python scripts/probes/trace_step_memory.py --height 392 --frames 1 8 16

Every tensor an operator returns is counted from its creation until its storage is freed; the
weights and the caches (allocated before the step) are not. The step runs in bf16 without
autocast (the meta device has none), so norms that autocast would widen to float32 are counted in
bf16. These traces set the heads' constants of models/stream/memory.py (per token x channel for their input
layers, per pixel for the DPT head); the aggregator's, which autocast's float32 outputs raise by ~40 %,
is measured on a GPU (scripts/probes/scale_step_memory.py), and `scripts/bench.py --gpu-memory` checks the
estimate against a GPU's peak.
"""

from __future__ import annotations

import argparse
import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stream_recon.cache import CacheLayout, TokenCache, backends
from stream_recon.models import GCTStream, ModelConfig


class LiveBytes(TorchDispatchMode):
    """The bytes of storages created inside the mode and still referenced, and their peak."""

    def __init__(self, ignore: list[torch.Tensor]):
        super().__init__()
        self.ignore = {t.untyped_storage()._cdata for t in ignore}
        self.sizes: dict[int, int] = {}
        self.references: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor):
                self._count(tensor)
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        key = tensor.untyped_storage()._cdata
        if key in self.ignore:
            return
        if key not in self.sizes:
            self.sizes[key], self.references[key] = tensor.untyped_storage().nbytes(), 0
            self.now += self.sizes[key]
            self.peak = max(self.peak, self.now)
        self.references[key] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        self.references[key] -= 1
        if not self.references[key]:
            self.now -= self.sizes.pop(key)
            del self.references[key]


def trace(model: GCTStream, height: int, width: int, num_frames: int, kv_cache: str) -> int:
    """Peak bytes of a step of `num_frames` frames (1: a streaming frame against a full window)."""
    c = model.config
    rows, cols = c.grid(height, width)
    layout = CacheLayout(rows * cols, c.num_special_tokens, 8, 64)
    cache = backends.build(backends.spec("sdpa"), layout, num_layers=c.depth, num_heads=c.num_heads,
                           head_dim=c.head_dim, max_frames=c.max_frames, dtype=torch.bfloat16, device="meta",
                           stored=backends.store_dtype(kv_cache, torch.bfloat16))
    camera = TokenCache(model.camera_head.num_cache_layers, c.camera_heads, c.head_in_dim // c.camera_heads,
                        torch.float32, "meta", capacity=c.max_frames)
    if num_frames == 1:  # the scale frames and a full window already cached
        for _ in range(layout.scale_frames + layout.window_frames):
            cache.append()
            cache.commit()
    for _ in range(num_frames):
        cache.append()
    cache.plan(num_frames * layout.tokens_per_frame)
    camera.begin(num_frames)
    images = torch.zeros(num_frames, 3, height, width, device="meta", dtype=torch.bfloat16)
    index = torch.arange(num_frames, device="meta")
    slots = cache.pending_slots()
    held = [cache.storage.store, *camera._keys, *camera._values, *model.parameters()]
    held += [] if cache.storage.exponents is None else [cache.storage.exponents]
    model.depth_head._uv_tables.clear()  # built by the first step of a frame size: counted
    mode = LiveBytes(held)
    with torch.inference_mode(), mode:
        model.step(images, cache.step(slots), camera, index, index, layout.scale_frames)
    return mode.peak


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--height", type=int, default=378)
    parser.add_argument("--width", type=int, default=518)
    parser.add_argument("--frames", type=int, nargs="+", default=[8, 1])
    parser.add_argument("--kv-cache", default="auto", choices=["auto", "fp8"])
    args = parser.parse_args()
    torch.autocast = lambda *a, **k: contextlib.nullcontext()  # the meta device has no autocast
    with torch.device("meta"):
        model = GCTStream(ModelConfig())
    model.aggregator.to(torch.bfloat16)
    model.depth_head.to(torch.bfloat16)
    model.eval().requires_grad_(False)
    c = model.config
    tokens = c.tokens_per_frame(args.height, args.width)
    for num_frames in args.frames:
        peak = trace(model, args.height, args.width, num_frames, args.kv_cache)
        print(f"{args.width}x{args.height}, {num_frames} frame(s): peak {peak / 2**20:.0f} MiB = "
              f"{peak / (num_frames * tokens * c.embed_dim):.1f} B per token x channel, "
              f"{peak / (args.height * args.width):.0f} B per pixel")


if __name__ == "__main__":
    main()
