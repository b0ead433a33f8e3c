"""Model configuration: frozen dataclasses with derived sizes as properties, and named presets."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the GCT streaming model (spec MODEL.md §0-§8).

    The defaults are the official checkpoints' configuration (`lingbot-map`, `lingbot-map-long`).
    """

    img_size: int = 518  # DINO positional table is trained at img_size x img_size
    patch_size: int = 14
    # DINOv2 trunk (patch embed); its width is embed_dim, since its patch tokens feed the aggregator
    dino_depth: int = 24
    dino_heads: int = 16
    dino_registers: int = 4
    # aggregator
    embed_dim: int = 1024
    depth: int = 24  # frame blocks = global blocks = depth
    num_heads: int = 16
    mlp_ratio: float = 4.0
    num_register_tokens: int = 4  # aggregator registers; specials = camera + registers + scale
    output_layers: tuple[int, ...] = (4, 11, 17, 23)
    rope2d_frequency: float = 100.0
    rope3d_theta: float = 10000.0
    rope3d_split: tuple[int, int, int] = (20, 22, 22)  # head-dim channels for time, rows, cols
    max_frames: int = 1024  # temporal RoPE table length
    # camera head
    camera_heads: int = 16
    camera_depth: int = 4
    camera_iterations: int = 4
    # depth head (DPT)
    dpt_features: int = 256
    dpt_out_channels: tuple[int, int, int, int] = (256, 512, 1024, 1024)

    def __post_init__(self):
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        if sum(self.rope3d_split) != self.head_dim:
            raise ValueError(f"rope3d_split {self.rope3d_split} must add up to the head dim {self.head_dim}")
        if any(not 0 <= i < self.depth for i in self.output_layers) or len(self.output_layers) != 4:
            raise ValueError(f"output_layers must be 4 block indices below depth={self.depth}, got {self.output_layers}")

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    @property
    def num_special_tokens(self) -> int:
        return 1 + self.num_register_tokens + 1

    @property
    def head_in_dim(self) -> int:
        """Channels the heads read: frame-block and global-block outputs side by side."""
        return 2 * self.embed_dim

    def grid(self, height: int, width: int) -> tuple[int, int]:
        return height // self.patch_size, width // self.patch_size

    def tokens_per_frame(self, height: int, width: int) -> int:
        rows, cols = self.grid(height, width)
        return self.num_special_tokens + rows * cols

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        tuples = {k: tuple(v) for k, v in values.items() if isinstance(v, list)}
        return cls(**{**values, **tuples})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_name(cls, name: str) -> ModelConfig:
        try:
            return cls(**PRESETS[name])
        except KeyError:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}") from None

    @classmethod
    def tiny(cls) -> ModelConfig:
        return cls.from_name("tiny")


PRESETS: dict[str, dict] = {
    # Both released checkpoints share one architecture (spec §12).
    "lingbot-map": {},
    "lingbot-map-long": {},
    # A few-MB model with every code path of the real one, for fast tests. Head dim stays 64 so the
    # temporal RoPE split is the official one.
    "tiny": dict(
        dino_depth=2, dino_heads=2, embed_dim=128, depth=4, num_heads=2,
        output_layers=(0, 1, 2, 3), camera_heads=2, camera_depth=2, camera_iterations=2,
        dpt_features=16, dpt_out_channels=(8, 16, 32, 32),
    ),
}
