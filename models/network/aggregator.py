"""Alternating frame / global attention over per-frame tokens (spec §3-§5)."""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .dino import DinoTrunk
from .layers import Block, CachedAttention
from .rope import Rope2D, Rope3D, patch_positions_2d, positions_3d

_IMAGE_MEAN = (0.485, 0.456, 0.406)
_IMAGE_STD = (0.229, 0.224, 0.225)


class Aggregator(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.config = c
        self.patch_embed = DinoTrunk(c.img_size, c.patch_size, c.embed_dim, c.dino_depth, c.dino_heads, c.dino_registers)
        self.frame_blocks = nn.ModuleList(
            Block(c.embed_dim, c.num_heads, c.mlp_ratio, qk_norm=True) for _ in range(c.depth)
        )
        self.global_blocks = nn.ModuleList(
            Block(c.embed_dim, c.num_heads, c.mlp_ratio, qk_norm=True) for _ in range(c.depth)
        )
        # Special tokens, each with two variants [1, 2, n, C]. Camera and registers: variant 0 marks
        # the very first frame of a stream (the world frame). Scale: variant 0 marks the anchor
        # (scale) frames, whose K/V are kept for the whole stream.
        self.camera_token = nn.Parameter(torch.zeros(1, 2, 1, c.embed_dim))
        self.register_token = nn.Parameter(torch.zeros(1, 2, c.num_register_tokens, c.embed_dim))
        self.scale_token = nn.Parameter(torch.zeros(1, 2, 1, c.embed_dim))

    def special_tokens(self, stream_index: torch.Tensor, num_scale_frames: int) -> torch.Tensor:
        """stream_index [S] (frame position since the stream started) -> [S, 6, C]."""
        first = (stream_index == 0).long()
        anchor = (stream_index < num_scale_frames).long()
        camera = self.camera_token[0, 1 - first]  # [S, 1, C]
        registers = self.register_token[0, 1 - first]  # [S, 4, C]
        scale = self.scale_token[0, 1 - anchor]  # [S, 1, C]
        return torch.cat([camera, registers, scale], dim=1)

    def forward(self, images: torch.Tensor, cache: CachedAttention, stream_index: torch.Tensor,
                time_index: torch.Tensor, num_scale_frames: int) -> list[torch.Tensor]:
        """Run S frames through the aggregator; their global attention reads and extends `cache`.

        images [S, 3, H, W] in [0, 1]; stream_index [S] position of each frame in the stream (selects
        special-token variants); time_index [S] temporal RoPE index of each frame.
        Returns the 4 output layers, each [S, P, 2C] (frame-block output | global-block output).
        """
        tokens = self.embed(images, stream_index, num_scale_frames)
        rows, cols = self.config.grid(*images.shape[-2:])
        return self.blocks(tokens, cache, time_index, rows, cols)

    def embed(self, images: torch.Tensor, stream_index: torch.Tensor, num_scale_frames: int) -> torch.Tensor:
        """The part that reads no cache: DINO patch tokens after the special tokens.

        images [S, 3, H, W] in [0, 1] -> tokens [S, P, C], P = 6 specials + rows * cols patches. A
        streaming engine may run this for the next frame before it knows whether the current one
        stays in the cache (flow keyframes).
        """
        # Python constants, not buffers (a model built on the meta device must not carry uninitialised
        # state) and not host tensors (copying one to the GPU inside a captured CUDA graph is illegal).
        x = torch.stack([(images[:, i] - m) / s for i, (m, s) in enumerate(zip(_IMAGE_MEAN, _IMAGE_STD, strict=True))], 1)
        patches = self.patch_embed(x)  # [S, rows * cols, C]
        specials = self.special_tokens(stream_index, num_scale_frames).to(patches.dtype)
        return torch.cat([specials, patches], dim=1)  # [S, P, C]

    def blocks(self, tokens: torch.Tensor, cache: CachedAttention, time_index: torch.Tensor, rows: int,
               cols: int) -> list[torch.Tensor]:
        """Alternating frame and global blocks over tokens [S, P, C] of a rows x cols patch grid;
        the global blocks attend through `cache`. Returns the 4 output layers [S, P, 2C]."""
        c = self.config
        num_frames, tokens_per_frame = tokens.shape[:2]
        frame_rope = Rope2D.build(
            patch_positions_2d(rows, cols, c.num_special_tokens, tokens.device), c.head_dim, c.rope2d_frequency
        )
        global_rope = Rope3D.build(
            positions_3d(time_index, rows, cols, c.num_special_tokens), c.rope3d_split, c.rope3d_theta
        )
        outputs = []
        for i in range(c.depth):
            tokens = self.frame_blocks[i](tokens, rope=frame_rope)  # per-frame attention, [S, P, C]
            frame_out = tokens
            tokens = tokens.reshape(1, num_frames * tokens_per_frame, -1)  # one sequence across frames
            tokens = self.global_blocks[i](tokens, rope=global_rope, cache=cache, layer=i)
            tokens = tokens.reshape(num_frames, tokens_per_frame, -1)
            if i in c.output_layers:
                outputs.append(torch.cat([frame_out, tokens], dim=-1))
        return outputs
