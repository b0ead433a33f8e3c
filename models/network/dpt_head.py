"""DPT depth head (spec §8): four aggregator layers fused RefineNet-style into a dense map."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


def uv_embedding(height: int, width: int, channels: int, aspect: float, device=None) -> torch.Tensor:
    """Sin-cos embedding of a centred UV grid spanning the image diagonal -> [channels, height, width].

    First half of the channels encodes x, second half y; computed in float64, returned as float32.
    """
    diagonal = math.sqrt(aspect * aspect + 1.0)
    span_x, span_y = aspect / diagonal, 1.0 / diagonal
    xs = torch.linspace(-span_x * (width - 1) / width, span_x * (width - 1) / width, width, dtype=torch.float32, device=device)
    ys = torch.linspace(-span_y * (height - 1) / height, span_y * (height - 1) / height, height, dtype=torch.float32, device=device)
    quarter = channels // 4
    omega = torch.arange(quarter, dtype=torch.float64, device=device) / quarter
    omega = 1.0 / 100.0**omega  # [C/4]

    def embed(coord: torch.Tensor) -> torch.Tensor:
        angle = coord.double()[:, None] * omega[None, :]
        return torch.cat([angle.sin(), angle.cos()], dim=-1)  # [n, C/2]

    ex = embed(xs)[None, :, :].expand(height, width, -1)
    ey = embed(ys)[:, None, :].expand(height, width, -1)
    return torch.cat([ex, ey], dim=-1).float().permute(2, 0, 1)


def resize_bilinear(x: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    return F.interpolate(x, size=size, mode="bilinear", align_corners=True)


class ResidualConvUnit(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.conv1 = nn.Conv2d(features, features, 3, padding=1)
        self.conv2 = nn.Conv2d(features, features, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The trained network used an in-place ReLU on the unit's input, so the skip connection
        # carries relu(x), not x. Reproduced on purpose (spec §8 quirk).
        x = F.relu(x)
        return self.conv2(F.relu(self.conv1(x))) + x


class FusionBlock(nn.Module):
    def __init__(self, features: int, has_skip: bool):
        super().__init__()
        if has_skip:
            self.resConfUnit1 = ResidualConvUnit(features)
        self.resConfUnit2 = ResidualConvUnit(features)
        self.out_conv = nn.Conv2d(features, features, 1)

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None, size: tuple[int, int]) -> torch.Tensor:
        if skip is not None:
            x = x + self.resConfUnit1(skip)
        x = self.resConfUnit2(x)
        return self.out_conv(resize_bilinear(x, size))


class Scratch(nn.Module):
    def __init__(self, out_channels: tuple[int, ...], features: int):
        super().__init__()
        for i, channels in enumerate(out_channels, start=1):
            setattr(self, f"layer{i}_rn", nn.Conv2d(channels, features, 3, padding=1, bias=False))
        self.refinenet1 = FusionBlock(features, has_skip=True)
        self.refinenet2 = FusionBlock(features, has_skip=True)
        self.refinenet3 = FusionBlock(features, has_skip=True)
        self.refinenet4 = FusionBlock(features, has_skip=False)
        self.output_conv1 = nn.Conv2d(features, features // 2, 3, padding=1)
        self.output_conv2 = nn.Sequential(
            nn.Conv2d(features // 2, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 2, 1)
        )


class DPTHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        c = config
        self.patch_size = c.patch_size
        self.num_special = c.num_special_tokens
        self.norm = nn.LayerNorm(c.head_in_dim)
        self.projects = nn.ModuleList(nn.Conv2d(c.head_in_dim, ch, 1) for ch in c.dpt_out_channels)
        ch = c.dpt_out_channels
        self.resize_layers = nn.ModuleList([
            nn.ConvTranspose2d(ch[0], ch[0], 4, stride=4),
            nn.ConvTranspose2d(ch[1], ch[1], 2, stride=2),
            nn.Identity(),
            nn.Conv2d(ch[3], ch[3], 3, stride=2, padding=1),
        ])
        self.scratch = Scratch(c.dpt_out_channels, c.dpt_features)
        self._uv_tables: dict[tuple, torch.Tensor] = {}  # constant per input size: built once, not per frame

    def uv_table_bytes(self, height: int, width: int) -> int:
        """Bytes of the float32 UV tables `forward` builds for frames of height x width and keeps
        (one per distinct shape: the patch grid at each projection's width, and the full image)."""
        rows, cols = height // self.patch_size, width // self.patch_size
        grids = {(rows, cols, project.out_channels) for project in self.projects}
        image = (rows * self.patch_size, cols * self.patch_size, self.scratch.output_conv1.out_channels)
        return 4 * sum(math.prod(shape) for shape in grids | {image})

    def uv_table(self, height: int, width: int, channels: int, aspect: float, device) -> torch.Tensor:
        key = (height, width, channels, aspect, str(device))
        if key not in self._uv_tables:
            self._uv_tables[key] = uv_embedding(height, width, channels, aspect, device)
        return self._uv_tables[key]

    def forward(self, layers: list[torch.Tensor], height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """layers: 4 x [S, P, 2C] (fp32) -> depth [S, H, W], confidence [S, H, W]."""
        rows, cols = height // self.patch_size, width // self.patch_size
        aspect = width / height
        device = layers[0].device
        grid_tables = [self.uv_table(rows, cols, project.out_channels, aspect, device) for project in self.projects]
        image_channels = self.scratch.output_conv1.out_channels
        image_table = self.uv_table(rows * self.patch_size, cols * self.patch_size, image_channels, aspect, device)
        # Frame by frame: a frame's full-resolution activations are a step's largest tensors (~170 MB
        # at 518x378 in bf16), and the scale frames' step would hold S times that beside a full
        # K/V cache (models/memory.py). One frame's shapes also serve every step (one compilation).
        frames = [self.decode([layer[i : i + 1] for layer in layers], grid_tables, image_table)
                  for i in range(layers[0].shape[0])]
        if len(frames) == 1:
            return frames[0]
        return torch.cat([depth for depth, _ in frames]), torch.cat([conf for _, conf in frames])

    def decode(self, layers: list[torch.Tensor], grid_tables: list[torch.Tensor],
               image_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The convolutional part: a pure function of tensors, so that it can be compiled.

        layers 4 x [S, P, 2C]; grid_tables 4 x [C_k, rows, cols] and image_table [F/2, H, W] (H, W rounded down to the
        patch grid), the
        UV embeddings added after each projection and after the last upsampling.
        """
        rows, cols = grid_tables[0].shape[1:]
        features = []
        for k, tokens in enumerate(layers):
            x = self.norm(tokens[:, self.num_special :])  # [S, rows * cols, 2C]
            # A view with channels-last strides, which the channels-last convolutions read as is.
            x = x.permute(0, 2, 1).reshape(x.shape[0], -1, rows, cols)
            x = self.projects[k](x)
            x = x + 0.1 * grid_tables[k].to(x.dtype)
            features.append(self.resize_layers[k](x))
        s = self.scratch
        l1, l2, l3, l4 = (getattr(s, f"layer{i}_rn")(f) for i, f in enumerate(features, start=1))
        out = s.refinenet4(l4, None, l3.shape[2:])
        out = s.refinenet3(out, l3, l2.shape[2:])
        out = s.refinenet2(out, l2, l1.shape[2:])
        out = s.refinenet1(out, l1, (2 * l1.shape[2], 2 * l1.shape[3]))
        out = s.output_conv1(out)
        out = resize_bilinear(out, tuple(image_table.shape[1:]))
        out = out + 0.1 * image_table.to(out.dtype)
        out = s.output_conv2(out).float()  # [S, 2, H, W]; the activations in float32 whatever the head's dtype
        return out[:, 0].exp(), 1 + out[:, 1].exp()
