"""The reference backend: the visible pages gathered in key order, then one unmasked PyTorch SDPA per layer.

Runs anywhere, in any precision; on the CPU in float32 it reproduces the official SDPA path up to summation
order (the golden-parity path). Over fp8 pages it reads the gathered codes dequantised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend_names import BackendSpec
from ..pages import CacheLayout, VisiblePages
from ..store import PagedKV


class SDPAPagedAttention:
    name = "sdpa"
    reads_plan_on_device = False  # its gather's rows are a new tensor each plan

    def __init__(self, kv: PagedKV):
        self.kv = kv
        self._rows: torch.Tensor | None = None  # [N] the visible keys' token rows

    def plan(self, visible: VisiblePages, num_queries: int) -> None:
        self._rows = self.kv.visible_rows(visible)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D] over the planned visible set, in the compute dtype (a bf16 cache attends
        in bf16, an fp32 cache in fp32)."""
        keys, values = self.kv.gather(layer, self._rows)  # [N, H, D] each
        out = F.scaled_dot_product_attention(
            q.to(keys.dtype).transpose(0, 1).unsqueeze(0),  # [1, H, T, D]
            keys.transpose(0, 1).unsqueeze(0),  # [1, H, N, D]
            values.transpose(0, 1).unsqueeze(0),
        )
        return out[0].transpose(0, 1)  # [T, H, D]


def _build(storage: PagedKV, layout: CacheLayout, compile, device: torch.device, most_keys: int) -> SDPAPagedAttention:
    return SDPAPagedAttention(storage)


ROW = BackendSpec(name="sdpa", factory=_build, cuda_half_only=False, reads_fp8=True, gathers=True,
                  summary="PyTorch SDPA over the gathered pages: the golden-parity reference, any device and dtype")
