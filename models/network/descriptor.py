"""A frame's retrieval descriptor from the network's own tokens: generalised-mean (GeM) pooling of the
DINO patch tokens (`GCTStream.descriptor`). Loop detection indexes it (models/loops/retrieval.py); the
network makes it without knowing what it is for.

The tokens come out of a LayerNorm and are signed, so GeM (a mean of p-th powers) pools their
magnitudes: a channel that responds strongly in either direction counts as strongly present. (ReLU
would read a channel that is strongly negative everywhere like an absent one; a per-channel shift needs
statistics over many images that a stream does not have at its start.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GEM_POWER = 3.0  # the usual GeM exponent (Radenović et al. 2018): between mean (p=1) and max (p->inf) pooling
GEM_EPS = 1e-6  # relative to a frame's largest magnitude: keeps the p-th root's gradient finite


def gem_descriptor(patch_tokens: torch.Tensor, p: float = GEM_POWER) -> torch.Tensor:
    """GeM over patches of |tokens|, L2-normalised: [..., P, C] -> [..., C] float32.

    [P, C] (one frame's patch tokens) gives one descriptor [C]; a leading batch [B, P, C] gives one per
    frame, [B, C] (frames are never pooled together). Special tokens (camera, registers, scale) are
    not patches: pass `tokens[..., num_special_tokens:, :]`.
    """
    if patch_tokens.ndim < 2 or patch_tokens.shape[-2] == 0 or not p > 0:
        raise ValueError(f"gem_descriptor needs [..., P, C] with P >= 1 and p > 0, got "
                         f"{tuple(patch_tokens.shape)} and p = {p}")
    magnitudes = patch_tokens.float().abs()
    # The descriptor is scale-free, so each frame's tokens are first divided by their largest magnitude
    # and the powers taken relative to each channel's largest: exact, and finite in float32 for any p
    # (|x|^p overflows at |x| = 4 when p = 64, at |x| = 5e12 when p = 3).
    magnitudes = magnitudes / magnitudes.amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    magnitudes = magnitudes.clamp_min(GEM_EPS)
    largest = magnitudes.amax(dim=-2, keepdim=True)  # [..., 1, C]
    pooled = largest.squeeze(-2) * (magnitudes / largest).pow(p).mean(dim=-2).pow(1.0 / p)  # [..., C]
    return F.normalize(pooled, dim=-1)
