"""FlashInfer paged-prefill backend over the same pages as the SDPA backend (CUDA only).

One `BatchPrefillWithPagedKVCacheWrapper` per engine: `plan` once per frame step from the
visible page table (scale | window | special), then `run` per global layer on that layer's pages.
Pages are NHD: kv_pages [num_pages, 2, page_size, H, D] in bf16/fp16 (FlashInfer has no fp32
kernels). RoPE is applied before K is cached, so the kernel runs with pos_encoding_mode "NONE",
and without a causal mask (every visible key is attended to).
"""

from __future__ import annotations

import torch

from .leftover_rows import KernelWaves, launch_ends
from .paged_attention import PagedKV
from .pages import VisiblePages

try:
    import flashinfer
except ImportError as error:  # re-raised with advice by the engine's backend choice
    raise ImportError(f"flashinfer is not importable ({error}); install the 'cuda' extra") from error

WORKSPACE_BYTES = 128 * 1024 * 1024
# The float workspace of the wrapper that runs a step's leftover rows (fewer than a wave's): its split of
# the keys keeps partial outputs of at most a wave's programs, 128 rows x 16 heads x 64 floats each
# (8.7 MB at 264 programs); the two engines of a rollover then hold 2 x (128 + 32) MB of workspace,
# within the memory model's 384 MB margin (models/stream/memory.py).
LEFTOVER_WORKSPACE_BYTES = 32 * 1024 * 1024


class FlashInferPagedAttention:
    name = "flashinfer"

    def __init__(self, kv: PagedKV, variant: str = "fa2"):
        if kv.device.type != "cuda":
            raise ValueError(f"FlashInfer needs a CUDA device, the cache is on {kv.device}")
        if kv.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"FlashInfer kernels take bf16/fp16 pages, got {kv.dtype}; use --attention sdpa for fp32")
        self.kv = kv
        self.variant = variant
        self.name = f"flashinfer-{variant}"
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=kv.device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, kv_layout="NHD", backend=variant)

    def plan(self, visible: VisiblePages, num_queries: int) -> None:
        device = self.kv.device
        self._wrapper.plan(
            torch.tensor([0, num_queries], dtype=torch.int32, device=device),
            torch.tensor([0, len(visible.page_ids)], dtype=torch.int32, device=device),
            torch.tensor(visible.page_ids, dtype=torch.int32, device=device),
            torch.tensor([visible.last_page_len], dtype=torch.int32, device=device),
            num_qo_heads=self.kv.num_heads,
            num_kv_heads=self.kv.num_heads,
            head_dim_qk=self.kv.head_dim,
            page_size=self.kv.page_size,
            causal=False,
            pos_encoding_mode="NONE",
            q_data_type=self.kv.dtype,
            kv_data_type=self.kv.dtype,
        )

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D] in the page dtype."""
        return self._wrapper.run(q.to(self.kv.dtype).contiguous(), self.kv.kv_pages[layer])


class FlashInferRangeAttention:
    """FlashInfer's ragged prefill over the dense layout's visible range (one sequence whose
    keys are tokens [start, end) of each layer's store, read in place). With the kernel's `waves`,
    the rows past its last whole wave run as a sequence of their own, planned apart
    (leftover_rows.py)."""

    def __init__(self, kv, variant: str = "fa3", waves: KernelWaves | None = None):
        if kv.device.type != "cuda" or kv.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"FlashInfer needs bf16/fp16 on a CUDA device, got {kv.dtype} on {kv.device}")
        self.kv = kv
        self.name = f"dense-flashinfer-{variant}"
        self.variant = variant
        self.waves = waves
        self._wrapper = self._new_wrapper()
        self._leftover_wrapper = None  # made by the first step that leaves rows over
        self._visible = None
        # (plan) where each launch's query rows end: the kernel's whole waves' rows, then the rest
        self.launch_ends: tuple[int, ...] = ()

    def _new_wrapper(self, workspace_bytes: int = WORKSPACE_BYTES):
        workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.kv.device)
        return flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout="NHD", backend=self.variant)

    def plan(self, visible, num_queries: int) -> None:
        self._visible = visible
        self.launch_ends = launch_ends(num_queries, self.kv.num_heads, self.waves)
        whole = self.launch_ends[0]
        self._plan(self._wrapper, whole, visible.num_tokens)
        if whole < num_queries:
            self._leftover_wrapper = self._leftover_wrapper or self._new_wrapper(LEFTOVER_WORKSPACE_BYTES)
            self._plan(self._leftover_wrapper, num_queries - whole, visible.num_tokens)

    def _plan(self, wrapper, num_queries: int, num_keys: int) -> None:
        device = self.kv.device
        wrapper.plan(
            torch.tensor([0, num_queries], dtype=torch.int32, device=device),
            torch.tensor([0, num_keys], dtype=torch.int32, device=device),
            num_qo_heads=self.kv.num_heads,
            num_kv_heads=self.kv.num_heads,
            head_dim_qk=self.kv.head_dim,
            causal=False,
            q_data_type=self.kv.dtype,
            kv_data_type=self.kv.dtype,
        )

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        keys, values = self.kv.keys_values(layer, self._visible.start, self._visible.end)
        q, whole = q.to(self.kv.dtype), self.launch_ends[0]
        if whole == q.shape[0]:
            return self._wrapper.run(q.contiguous(), keys, values)
        return torch.cat([self._wrapper.run(q[:whole].contiguous(), keys, values),
                          self._leftover_wrapper.run(q[whole:].contiguous(), keys, values)])
