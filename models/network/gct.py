"""The GCT streaming network: aggregator, causal camera head and DPT depth head."""

from __future__ import annotations

import threading

import torch
from torch import nn

from stream_recon.cache import run_beside

from .aggregator import Aggregator
from .camera_head import CameraHead
from .config import ModelConfig
from .descriptor import gem_descriptor
from .dpt_head import DPTHead
from .layers import CachedAttention


class _SideStreams(threading.local):
    """The camera head's stream, one per thread and device (kept off the module so that it
    deep-copies): a side stream joins the capture of the stream it waits for, so one shared by two
    threads would take one thread's kernels into the other's capture (cudaErrorStreamCaptureUnjoined
    with one thread recording graphs while another steps eagerly)."""

    def __init__(self):
        self.by_device: dict[torch.device, torch.cuda.Stream] = {}


_SIDE_STREAMS = _SideStreams()


class GCTStream(nn.Module):
    """Parameter names match the official checkpoints (spec/checkpoint_keys.tsv)."""

    def __init__(self, config: ModelConfig | None = None):
        super().__init__()
        self.config = config or ModelConfig()
        self.aggregator = Aggregator(self.config)
        self.camera_head = CameraHead(self.config)
        self.depth_head = DPTHead(self.config)

    def _run_heads(self, on_cuda: bool, camera, depth):
        """Both heads' results. On CUDA the camera head runs on a side stream while the DPT head runs
        on the current one: the camera head is bound by reading its weights (16 one-token blocks in
        float32), the DPT head by convolution arithmetic, so the two overlap well."""
        side = None
        if on_cuda:
            device = torch.cuda.current_stream().device
            streams = _SIDE_STREAMS.by_device
            if device not in streams:
                # High priority: the camera head is the longer of the two, so its kernels go first.
                streams[device] = torch.cuda.Stream(device, priority=-1)
            side = streams[device]
        return run_beside(side, camera, depth)

    def step(self, images: torch.Tensor, kv: CachedAttention, camera_kv: CachedAttention,
             stream_index: torch.Tensor, time_index: torch.Tensor, num_scale_frames: int,
             descriptors: bool = False) -> dict[str, torch.Tensor]:
        """Predict S frames that join the stream together (S > 1 only for the scale frames).

        images [S, 3, H, W] in [0, 1]; kv serves the global blocks, camera_kv the camera head.
        Returns pose_enc [S, 9], pose_enc_list (per refinement iteration), depth [S, H, W] and
        depth_conf [S, H, W], all float32; with `descriptors` also descriptor [S, C] (`descriptor`).
        """
        if not descriptors:
            layers = self.aggregator(images, kv, stream_index, time_index, num_scale_frames)
            return self.predict(layers, camera_kv, *images.shape[-2:])
        tokens = self.aggregator.embed(images, stream_index, num_scale_frames)  # the aggregator's two parts
        layers = self.aggregator.blocks(tokens, kv, time_index, *self.config.grid(*images.shape[-2:]))
        return {**self.predict(layers, camera_kv, *images.shape[-2:]), "descriptor": self.descriptor(tokens)}

    def descriptor(self, tokens: torch.Tensor) -> torch.Tensor:
        """A global descriptor per frame for loop retrieval: GeM of its DINO patch tokens (the embedding's
        output [S, P, C], special tokens first), unit length, [S, C] float32 (models/loop_retrieval.py)."""
        return gem_descriptor(tokens[:, self.config.num_special_tokens:])

    def predict(self, layers: list[torch.Tensor], camera_kv: CachedAttention, height: int,
                width: int) -> dict[str, torch.Tensor]:
        """Both heads on the aggregator's 4 output layers ([S, P, 2C] each); the outputs of `step`."""
        # The camera head computes in float32 whatever the trunk's dtype, as the reference does (in
        # bf16 its pose error doubled); on CUDA the engine stores its large weights in float16
        # (few_token_linear). The DPT head runs in its weights' dtype: float32 unless the engine
        # gave it the trunk's half precision (1.5 -> 1.0 ms a frame at 518x378).
        camera_tokens = layers[-1][:, 0].float()
        depth_dtype = self.depth_head.norm.weight.dtype
        depth_layers = [layer.to(depth_dtype) for layer in layers]
        with torch.autocast(device_type=camera_tokens.device.type, enabled=False):
            poses, (depth, depth_conf) = self._run_heads(
                camera_tokens.is_cuda,
                lambda: self.camera_head(camera_tokens, camera_kv), lambda: self.depth_head(depth_layers, height, width)
            )
        return {"pose_enc": poses[-1], "pose_enc_list": poses, "depth": depth, "depth_conf": depth_conf}
