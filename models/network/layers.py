"""Transformer building blocks shared by the DINO trunk, the aggregator and the camera head."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from stream_recon.cache.packages import importable

# The fused QK-norm + RoPE kernel for CUDA; without triton the unfused path serves every case.
if importable("triton"):
    from . import qk_norm_rope
else:
    qk_norm_rope = None

# A rotary embedding acting on q or k laid out [B, N, H, D] (token-major).
Rope = Callable[[torch.Tensor], torch.Tensor]
# Attention over a cache: (layer, q, k, v) with [N, H, D] tensors -> [N, H, D].
CachedAttention = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Unmasked attention of each sequence over itself: q, k, v [B, H, N, D] -> [B, H, N, D].
SelfAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, out_dim: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()  # a module, so that a fused fc1 can take it over (few_token_linear)
        self.fc2 = nn.Linear(hidden, out_dim or dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    """Multi-head self-attention with optional per-head QK-norm, RoPE and a KV cache."""

    def __init__(self, dim: int, num_heads: int, qk_norm: bool = False, norm_eps: float = 1e-5):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        # QK-norm: LayerNorm over each head's channels, before RoPE.
        self.q_norm = nn.LayerNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim, eps=norm_eps) if qk_norm else nn.Identity()
        self.proj = nn.Linear(dim, dim)
        # Without a cache (DINO and frame blocks): PyTorch's SDPA, unless a prepared model put
        # another kernel here (prepare.py, use_range_kernel_for_frames).
        self.self_attention: SelfAttention = F.scaled_dot_product_attention

    def heads(self, x: torch.Tensor, rope: Rope | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, N, C] -> q, k, v [B, H, N, D], QK-normed and rotated: transposed views of token-major
        [B, N, H, D] tensors, the layout a KV cache stores and attention kernels read as they are,
        so that neither path makes a transposing copy."""
        B, N, C = x.shape
        qkv = self.qkv(x)
        q, k, v = qkv.reshape(B, N, 3, self.num_heads, self.head_dim).unbind(2)  # [B, N, H, D]
        if qk_norm_rope is not None and qk_norm_rope.applies(qkv, self.q_norm, self.k_norm, rope):
            q, k = qk_norm_rope.qk_norm_rope(qkv, self.num_heads, self.q_norm, self.k_norm, rope)
            return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = rope(q), rope(k)
        # Under autocast the norms and RoPE run in float32 and the attention kernels take v's dtype;
        # casting here (where a compiled block fuses it) rounds at the same point as the kernel would.
        return q.to(v.dtype).transpose(1, 2), k.to(v.dtype).transpose(1, 2), v.transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: CachedAttention | None = None,
               layer: int = 0) -> torch.Tensor:
        """[B, H, N, D] each -> [B, N, H * D]. With `cache` (B = 1), keys come from the cache after
        this step's K/V are written to it."""
        B, H, N, D = q.shape
        if cache is None:
            out = self.self_attention(q, k, v)
        else:
            if B != 1:
                raise ValueError(f"cached attention streams one sequence at a time, got batch {B}")
            out = cache(layer, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1))  # [N, H, D]
            out = out.transpose(0, 1).unsqueeze(0)
        return out.transpose(1, 2).reshape(B, N, H * D)

    def forward(self, x: torch.Tensor, rope: Rope | None = None,
                cache: CachedAttention | None = None, layer: int = 0) -> torch.Tensor:
        """x [B, N, C] -> [B, N, C]."""
        return self.proj(self.attend(*self.heads(x, rope), cache=cache, layer=layer))


class Block(nn.Module):
    """Pre-norm transformer block with LayerScale on both residual branches."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qk_norm: bool = False,
                 norm_eps: float = 1e-5):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, num_heads, qk_norm=qk_norm, norm_eps=norm_eps)
        self.ls1 = LayerScale(dim)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.ls2 = LayerScale(dim)

    def forward(self, x: torch.Tensor, rope: Rope | None = None,
                cache: CachedAttention | None = None, layer: int = 0) -> torch.Tensor:
        q, k, v = self.attention_inputs(x, rope)
        return self.attention_outputs(x, self.attn.attend(q, k, v, cache=cache, layer=layer))

    # The two halves around the attention call: free of cache access and of Python state, so that
    # they can be compiled (fused) on their own while the attention stays whatever backend it is.
    def attention_inputs(self, x: torch.Tensor, rope: Rope | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.attn.heads(self.norm1(x), rope)

    def attention_outputs(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """x [B, N, C] residual stream, attended [B, N, C] (before the output projection)."""
        x = x + self.ls1(self.attn.proj(attended))
        return x + self.ls2(self.mlp(self.norm2(x)))
