"""DINOv2 ViT-L/14 with registers: the patch-embedding trunk of the aggregator (spec §2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Block


class PatchConv(nn.Module):
    def __init__(self, patch_size: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)  # [N, rows * cols, C]


class DinoTrunk(nn.Module):
    """images [N, 3, H, W] (normalised) -> patch tokens [N, rows * cols, C] after the final norm."""

    def __init__(self, img_size: int, patch_size: int, dim: int, depth: int, num_heads: int, num_registers: int):
        super().__init__()
        self.patch_size = patch_size
        self.trained_grid = img_size // patch_size
        self.patch_embed = PatchConv(patch_size, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + self.trained_grid**2, dim))
        self.register_tokens = nn.Parameter(torch.zeros(1, num_registers, dim))
        # Only used for masked pre-training; kept so that checkpoints load strictly.
        self.mask_token = nn.Parameter(torch.zeros(1, dim), requires_grad=False)
        self.blocks = nn.ModuleList(Block(dim, num_heads, norm_eps=1e-6) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.num_registers = num_registers
        self._resized_tables: dict[tuple, torch.Tensor] = {}

    def positional_embedding(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """The trained square table resized to the input grid -> [1, 1 + rows * cols, C]. Resized
        once per grid (a bicubic, antialiased resize each frame costs ~0.1 ms)."""
        if rows == cols == self.trained_grid:
            return self.pos_embed
        table = self.pos_embed
        # The weights' identity and version are part of the key: loading a checkpoint invalidates it.
        key = (rows, cols, dtype, table.device, table.data_ptr(), table._version)
        if key not in self._resized_tables:
            self._resized_tables = {key: self._resize_table(rows, cols, dtype)}
        return self._resized_tables[key]

    def _resize_table(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        table = self.pos_embed.float()
        cls_pos, grid_pos = table[:, :1], table[:, 1:]
        grid = self.trained_grid
        grid_pos = grid_pos.reshape(1, grid, grid, -1).permute(0, 3, 1, 2)  # [1, C, grid, grid]
        grid_pos = F.interpolate(grid_pos, size=(rows, cols), mode="bicubic", antialias=True)
        grid_pos = grid_pos.permute(0, 2, 3, 1).reshape(1, rows * cols, -1)
        return torch.cat([cls_pos, grid_pos], dim=1).to(dtype)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        n, _, height, width = images.shape
        rows, cols = height // self.patch_size, width // self.patch_size
        x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(n, -1, -1), x], dim=1)
        x = x + self.positional_embedding(rows, cols, x.dtype)
        # Registers sit after cls and carry no positional embedding.
        x = torch.cat([x[:, :1], self.register_tokens.expand(n, -1, -1), x[:, 1:]], dim=1)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return x[:, 1 + self.num_registers :]
