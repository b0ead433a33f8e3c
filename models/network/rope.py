"""Rotary position embeddings: 2D (frame blocks) and 3D temporal (global blocks).

Both are applied to q and k laid out token-major, [B, N, H, D], and are pure functions of
precomputed tables [N, D/2] (shared by the heads), so a step builds its tables once and every
layer reuses them.

Both are also one linear map, out[d] = x[d] * cos_full[n, d] + x[partner(d)] * sin_signed[n, d],
with partner(d) = d +- pair_offset (pairs of channels pair_offset apart, in blocks of 2 * pair_offset).
Each rope builds that expanded form with its tables, so that one fused kernel (qk_norm_rope.py)
serves both kinds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def patch_positions_2d(rows: int, cols: int, num_special: int, device=None) -> torch.Tensor:
    """(y, x) per token of one frame: specials at (0, 0), patch (r, c) at (r + 1, c + 1).

    -> [P, 2] int64, tokens in model order (specials, then patches row-major).
    """
    r, c = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
    patches = torch.stack([r.reshape(-1), c.reshape(-1)], dim=-1) + 1
    specials = torch.zeros(num_special, 2, dtype=torch.long, device=device)
    return torch.cat([specials, patches], dim=0)


@dataclass(frozen=True)
class Rope2D:
    """Rotate-half RoPE per axis: channels [0, D/2) by y, [D/2, D) by x, base `frequency`.

    cos_y, sin_y, cos_x, sin_x: [N, D/2] float32.
    """

    cos_y: torch.Tensor
    sin_y: torch.Tensor
    cos_x: torch.Tensor
    sin_x: torch.Tensor
    cos_full: torch.Tensor = field(init=False, repr=False)  # [N, D] float32
    sin_signed: torch.Tensor = field(init=False, repr=False)  # [N, D] float32

    def __post_init__(self):
        quarter = self.cos_y.shape[-1] // 2  # rotate-half within each axis half: partner d +- D/4

        def signed(sin: torch.Tensor) -> torch.Tensor:
            return torch.cat([-sin[:, :quarter], sin[:, quarter:]], dim=-1)

        object.__setattr__(self, "cos_full", torch.cat([self.cos_y, self.cos_x], dim=-1))
        object.__setattr__(self, "sin_signed", torch.cat([signed(self.sin_y), signed(self.sin_x)], dim=-1))

    @property
    def pair_offset(self) -> int:
        return self.cos_y.shape[-1] // 2

    @classmethod
    def build(cls, positions: torch.Tensor, head_dim: int, frequency: float) -> Rope2D:
        axis_dim = head_dim // 2
        # Same arithmetic as the reference table: fp32 inverse frequencies, fp32 angles.
        exponents = torch.arange(0, axis_dim, 2, device=positions.device).float() / axis_dim
        inv_freq = 1.0 / (frequency**exponents)  # [axis_dim / 2]

        def table(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            angles = p.float()[:, None] * inv_freq[None, :]
            angles = torch.cat([angles, angles], dim=-1)  # [N, axis_dim]
            return angles.cos(), angles.sin()

        cos_y, sin_y = table(positions[:, 0])
        cos_x, sin_x = table(positions[:, 1])
        return cls(cos_y, sin_y, cos_x, sin_x)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, H, D] -> the same, rotated."""
        y_part, x_part = x.chunk(2, dim=-1)
        return torch.cat([_rotate_half(y_part, self.cos_y[:, None], self.sin_y[:, None]),
                          _rotate_half(x_part, self.cos_x[:, None], self.sin_x[:, None])], dim=-1)


def _rotate_half(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = t.shape[-1] // 2
    rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
    return t * cos.to(t.dtype) + rotated * sin.to(t.dtype)


def positions_3d(time_index: torch.Tensor, rows: int, cols: int, num_special: int) -> torch.Tensor:
    """(t, h, w) per token of S frames: special s -> (t, s, s); patch (r, c) -> (t, 6 + r, 6 + c).

    time_index [S] -> [S * P, 3] int64, frame-major, tokens in model order.
    """
    device = time_index.device
    s = torch.arange(num_special, device=device)
    special_hw = torch.stack([s, s], dim=-1)
    r, c = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
    patch_hw = torch.stack([r.reshape(-1), c.reshape(-1)], dim=-1) + num_special
    hw = torch.cat([special_hw, patch_hw], dim=0)  # [P, 2]
    num_frames, tokens = time_index.shape[0], hw.shape[0]
    t = time_index[:, None, None].expand(num_frames, tokens, 1)
    return torch.cat([t, hw[None].expand(num_frames, tokens, 2)], dim=-1).reshape(-1, 3)


@dataclass(frozen=True)
class Rope3D:
    """Interleaved-pair RoPE over (time, row, col); pair k = channels (2k, 2k + 1).

    cos, sin: [N, D/2] float32 (angles and their cos/sin in float64, then cast, as the reference).
    Temporal positions must be below the model's `max_frames` (the trained table); the engine checks, since
    reading a device tensor here would stall the stream (and break CUDA-graph capture).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    cos_full: torch.Tensor = field(init=False, repr=False)  # [N, D] float32
    sin_signed: torch.Tensor = field(init=False, repr=False)  # [N, D] float32

    def __post_init__(self):
        object.__setattr__(self, "cos_full", self.cos.repeat_interleave(2, dim=-1))
        object.__setattr__(self, "sin_signed", torch.stack([-self.sin, self.sin], dim=-1).flatten(-2))

    @property
    def pair_offset(self) -> int:
        return 1

    @classmethod
    def build(cls, positions: torch.Tensor, split: tuple[int, int, int], theta: float) -> Rope3D:
        angles = []
        for axis, dim in enumerate(split):
            freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device)[: dim // 2] / dim))
            angles.append(positions[:, axis].double()[:, None] * freqs[None, :])
        angle = torch.cat(angles, dim=-1)  # [N, D/2] float64
        return cls(angle.cos().float(), angle.sin().float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, H, D] -> the same, rotated."""
        cos, sin = self.cos[:, None].to(x.dtype), self.sin[:, None].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).reshape(x.shape)


def pair_partners(head_dim: int, pair_offset: int, device=None) -> torch.Tensor:
    """partner(d) of the expanded form: [D] int64."""
    d = torch.arange(head_dim, device=device)
    return d + torch.where((d // pair_offset) % 2 == 0, pair_offset, -pair_offset)


def rotate_expanded(x: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor, pair_offset: int) -> torch.Tensor:
    """x [B, N, H, D] float32, tables [N, D] -> what Rope2D / Rope3D compute, bit for bit."""
    partners = pair_partners(x.shape[-1], pair_offset, x.device)
    return x * cos_full[:, None] + x[..., partners] * sin_signed[:, None]
