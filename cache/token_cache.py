"""Growable per-layer K/V of one token per frame: the camera head's causal cache.

The camera head attends over the camera token of every committed frame (never evicted) plus the
current frame(s). Pending entries are visible to the step that wrote them and are dropped on
rollback, like the patch and special pages of the aggregator cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TokenCache:
    def __init__(self, num_layers: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 64):
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_committed = 0
        self.num_pending = 0
        self._keys = [self._empty(capacity) for _ in range(num_layers)]  # [capacity, H, D] each
        self._values = [self._empty(capacity) for _ in range(num_layers)]

    def _empty(self, capacity: int) -> torch.Tensor:
        return torch.zeros(capacity, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self._keys[0].shape[0]

    @property
    def bytes_allocated(self) -> int:
        return 2 * sum(t.numel() * t.element_size() for t in self._keys)

    def begin(self, num_tokens: int) -> None:
        """Open a step that adds `num_tokens` pending tokens per layer."""
        if self.num_pending:
            raise RuntimeError("the previous camera-cache step was neither committed nor rolled back")
        needed = self.num_committed + num_tokens
        if needed > self.capacity:
            # Double, so that a long stream re-allocates O(log n) times.
            new_capacity = max(needed, 2 * self.capacity)
            for store in (self._keys, self._values):
                for i, old in enumerate(store):
                    grown = self._empty(new_capacity)
                    grown[: old.shape[0]] = old
                    store[i] = grown
        self.num_pending = num_tokens

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [T, H, D] -> [T, H, D]; keys = committed tokens + this step's tokens."""
        start, end = self.num_committed, self.num_committed + self.num_pending
        self._keys[layer][start:end] = k.to(self.dtype)
        self._values[layer][start:end] = v.to(self.dtype)
        keys = self._keys[layer][:end].transpose(0, 1).unsqueeze(0)  # [1, H, N, D]
        values = self._values[layer][:end].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), keys.to(q.dtype), values.to(q.dtype))
        return out[0].transpose(0, 1)

    def commit(self) -> None:
        self.num_committed += self.num_pending
        self.num_pending = 0

    def rollback(self) -> None:
        self.num_pending = 0

    def reset(self) -> None:
        self.num_committed = 0
        self.num_pending = 0
