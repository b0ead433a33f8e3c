"""Growable per-layer K/V of one token per frame: the camera head's causal cache.

The camera head attends over the camera token of every committed frame (never evicted) plus the
current frame(s). Pending entries are visible to the step that wrote them and are dropped on
rollback, like the patch and special pages of the aggregator cache.

Where this step writes is held in a device tensor, and attention runs over the whole capacity
with a length mask, so a step has static shapes and can be replayed as a CUDA graph; `version`
changes whenever the storage is re-allocated (a recorded graph is then stale).
"""

from __future__ import annotations

import torch

from .compiling import Compile, compiled


class TokenCache:
    def __init__(self, num_layers: int, num_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 64, compile: Compile = False):
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_committed = 0
        self.num_pending = 0
        self.version = 0
        self._start = torch.zeros((), dtype=torch.long, device=self.device)  # first pending position
        # compile: the masked attention's small kernels (its shapes are fixed) fused into a few.
        self._attend = compiled(attend_over_capacity, compile)
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

    @staticmethod
    def bytes_needed(num_layers: int, num_heads: int, head_dim: int, capacity: int, dtype: torch.dtype) -> int:
        """Bytes a cache of `capacity` tokens takes (keys and values of every layer)."""
        return 2 * num_layers * capacity * num_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def begin(self, num_tokens: int) -> None:
        """Open a step that adds `num_tokens` pending tokens per layer."""
        if self.num_pending:
            raise RuntimeError("the previous camera-cache step was neither committed nor rolled back")
        self._make_room(self.num_committed + num_tokens)
        self._start.fill_(self.num_committed)
        self.num_pending = num_tokens

    def _make_room(self, needed: int) -> None:
        if needed > self.capacity:
            # Double, so that a long stream re-allocates O(log n) times.
            new_capacity = max(needed, 2 * self.capacity)
            for store in (self._keys, self._values):
                for i, old in enumerate(store):
                    grown = self._empty(new_capacity)
                    grown[: old.shape[0]] = old
                    store[i] = grown
            self.version += 1

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v [T, H, D] -> [T, H, D]; keys = committed tokens + this step's tokens."""
        count = k.shape[0]
        positions = self._start + torch.arange(count, device=self.device)
        keys, values = self._keys[layer], self._values[layer]
        keys.index_copy_(0, positions, k.to(self.dtype))
        values.index_copy_(0, positions, v.to(self.dtype))
        return self._attend(q, keys.to(q.dtype), values.to(q.dtype), self._start + count)

    def commit(self) -> None:
        self.num_committed += self.num_pending
        self.num_pending = 0

    def rollback(self) -> None:
        self.num_pending = 0

    def reset(self) -> None:
        self.num_committed = 0
        self.num_pending = 0

    def clear(self) -> None:
        """Forget every token and zero the storage, as allocated: the attention weighs every position
        (those past the live ones by zero, and zero times NaN is NaN), so no garbage may stay there."""
        self.reset()
        for tensor in self._keys + self._values:
            tensor.zero_()

    def take_over(self, other: TokenCache) -> None:
        """Hold `other`'s committed tokens (copied, on the current stream); nothing may be pending there."""
        if other.num_pending:
            raise ValueError("a camera cache takes over committed tokens only: commit or roll back first")
        if (other.num_layers, other.num_heads, other.head_dim) != (self.num_layers, self.num_heads, self.head_dim):
            raise ValueError("a camera cache takes over only from one of its shape")
        count = other.num_committed
        self._make_room(count)
        for mine, theirs in ((self._keys, other._keys), (self._values, other._values)):
            for layer in range(self.num_layers):
                mine[layer][:count] = theirs[layer][:count]
        self.num_committed, self.num_pending = count, 0


def attend_over_capacity(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, live_end: torch.Tensor) -> torch.Tensor:
    """q [T, H, D] against keys, values [capacity, H, D] of which positions >= live_end (a 0-d
    device tensor) are masked out -> [T, H, D]."""
    scores = torch.einsum("thd,nhd->htn", q, keys) * q.shape[-1] ** -0.5  # [H, T, capacity]
    beyond = torch.arange(keys.shape[0], device=keys.device) >= live_end
    weights = scores.masked_fill(beyond, float("-inf")).softmax(dim=-1)
    return torch.einsum("htn,nhd->thd", weights, values)
