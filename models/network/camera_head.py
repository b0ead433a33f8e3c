"""Causal camera head: iterative pose refinement over the camera tokens (spec §6)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import Block, CachedAttention, Mlp

POSE_DIM = 9  # t_xyz, quat_xyzw, fov_h, fov_w


def activate_pose(raw: torch.Tensor) -> torch.Tensor:
    """Translation and quaternion pass through; field of view goes through a ReLU."""
    return torch.cat([raw[..., :7], F.relu(raw[..., 7:])], dim=-1)


class CameraHead(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        dim = config.head_in_dim
        self.num_iterations = config.camera_iterations
        self.depth = config.camera_depth
        self.trunk = nn.Sequential(*(Block(dim, config.camera_heads, 4.0) for _ in range(config.camera_depth)))
        self.token_norm = nn.LayerNorm(dim)
        self.trunk_norm = nn.LayerNorm(dim)
        self.empty_pose_tokens = nn.Parameter(torch.zeros(1, 1, POSE_DIM))
        self.embed_pose = nn.Linear(POSE_DIM, dim)
        self.poseLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 3 * dim))
        self.adaln_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.pose_branch = Mlp(dim, dim // 2, POSE_DIM)

    @property
    def num_cache_layers(self) -> int:
        """One causal K/V cache per (iteration, trunk block)."""
        return self.num_iterations * self.depth

    def cache_layers(self, num_iterations: int | None = None) -> int:
        """The causal K/V cache layers of `num_iterations` refinement iterations (None: all of them)."""
        return (num_iterations or self.num_iterations) * self.depth

    def iterations_for(self, cache: CachedAttention) -> int:
        """The refinement iterations a step runs: one per `depth` layers of the camera cache it is given
        (models.stream's TokenCache; an engine that runs fewer iterations caches fewer layers), so that
        the loop and the cache cannot disagree; all of them for a cache without a layer count."""
        layers = getattr(cache, "num_layers", self.num_cache_layers)
        return max(1, min(self.num_iterations, layers // self.depth))

    def forward(self, camera_tokens: torch.Tensor, cache: CachedAttention) -> list[torch.Tensor]:
        """camera_tokens [S, 2C] (token 0 of the last aggregator layer, fp32) -> one activated
        pose [S, 9] per refinement iteration (iterations_for(cache) of them). Each frame attends to the
        cached camera tokens of earlier frames plus this step's frames."""
        tokens = self.token_norm(camera_tokens)[None]  # [1, S, 2C]
        raw = None
        poses = []
        for i in range(self.iterations_for(cache)):
            pose_in = self.empty_pose_tokens.expand(1, tokens.shape[1], -1) if raw is None else raw
            x = self.condition(tokens, pose_in)
            for j, block in enumerate(self.trunk):
                x = block(x, cache=cache, layer=i * self.depth + j)
            raw, pose = self.refine(x, raw)
            poses.append(pose[0])
        return poses

    # The parts of an iteration around the trunk: pure tensor functions, so that they can be compiled.
    def condition(self, tokens: torch.Tensor, pose_in: torch.Tensor) -> torch.Tensor:
        """The trunk's input: camera tokens [1, S, 2C] modulated (adaLN) by the pose so far [1, S, 9]."""
        shift, scale, gate = self.poseLN_modulation(self.embed_pose(pose_in)).chunk(3, dim=-1)
        return gate * (self.adaln_norm(tokens) * (1 + scale) + shift) + tokens

    def refine(self, x: torch.Tensor, raw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Trunk output [1, S, 2C] -> (raw running pose sum, activated pose), each [1, S, 9]. The next
        iteration is conditioned on the raw (pre-activation) sum."""
        delta = self.pose_branch(self.trunk_norm(x))
        raw = delta if raw is None else raw + delta
        return raw, activate_pose(raw)
