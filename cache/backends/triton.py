"""Our range kernel over the pages (cache/triton_attention.py; on Hopper its Gluon version,
cache/gluon_attention.py): the step's keys as a few runs of token rows, their run table read on the device.

`plan` coalesces the visible page table into runs (VisiblePages.runs) and uploads their run table into a
fixed device buffer (through a pinned buffer, on the current stream), so that a step enqueued after it,
replayed from a CUDA graph or not, reads this step's keys: the whole aggregator step is one graph. fp8 pages
are read through one reused buffer in the compute dtype: each layer's runs dequantised into it side by side
(one memory-bound Triton pass, exact), then the same kernel over that one range. Converting the e4m3 blocks
inside the kernel instead took it from 25.2 to 43.1 ms per frame, the buffer to 28.3: the kernel is bound by
latency (two warps per scheduler, neither ready on 57 % of cycles), and the conversions lengthen each
block's dependent chain and send the converted blocks back through shared memory before the products.
"""

from __future__ import annotations

import torch

from .. import fp8
from ..backend_names import BackendSpec
from ..pages import CacheLayout, VisiblePages
from ..store import PagedKV
from ..streams import DeviceValues


class TritonPagedAttention:
    name = "triton"
    reads_plan_on_device = True  # a recorded step may include the attention itself

    def __init__(self, kv: PagedKV, schedule_keys: int):
        # Triton: absent on some machines, imported when this backend is built
        from .. import triton_attention, triton_store

        self.kernels, self.store_kernels = triton_attention, triton_store
        self.kv = kv
        self.schedule_keys = schedule_keys  # the most keys a step of the stream reads (attend_range)
        self.max_runs = kv.num_pages  # (a visible page is one run at most)
        self._runs = self._table(self.max_runs)
        self._scratch: torch.Tensor | None = None  # [2, keys, H, D] in the compute dtype (fp8 pages; made at plan)
        self._scratch_runs = self._table(1)

    def _table(self, max_runs: int) -> DeviceValues:
        size = self.kernels.RUN_TABLE_HEAD + self.kernels.RUN_ENTRY * max_runs
        return DeviceValues(size, torch.int32, self.kv.device)

    def plan(self, visible: VisiblePages, num_queries: int) -> None:
        runs = visible.runs()
        if len(runs) > self.max_runs:  # (a pool that grew: the CPU's, which records no graph)
            self.max_runs = self.kv.num_pages
            self._runs = self._table(self.max_runs)
        self._runs.set(*self.kernels.run_table(runs, self.max_runs))
        if self.kv.quantized:
            self._scratch_runs.set(*self.kernels.run_table([(0, visible.num_tokens)], 1))
            if self._scratch is None or self._scratch.shape[1] < visible.num_tokens:  # (on the GPU: once)
                rows = max(self.schedule_keys, visible.num_tokens)
                # zeros: what the kernel reads past the keys is finite (store.py)
                self._scratch = torch.zeros(2, rows, self.kv.num_heads, self.kv.head_dim, dtype=self.kv.dtype,
                                            device=self.kv.device)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D], in the compute dtype."""
        query = q.to(self.kv.dtype).contiguous()
        store = self.kv.layers[layer]  # [2, N * P, H, D]
        if not self.kv.quantized:
            return self.kernels.attend_range(query, store[0], store[1], self._runs.values,
                                             schedule_keys=self.schedule_keys)
        self.store_kernels.dequantize_runs(store, self.kv.exponents[layer], self._runs.values, self._scratch)
        return self.kernels.attend_range(query, self._scratch[0], self._scratch[1], self._scratch_runs.values,
                                         schedule_keys=self.schedule_keys)


def _build(storage: PagedKV, layout: CacheLayout, compile, device: torch.device, most_keys: int) -> TritonPagedAttention:
    # The schedule is the whole window's pool's, whatever this cache's pool and storage hold (a spare's fewer
    # window pages, a storage holding a spare's block besides), so that a spare computes bit for bit as the
    # engine it hands its frames over to, and an engine with a block beside it as one without.
    return TritonPagedAttention(storage, schedule_keys=most_keys)


# (Ampere on: bf16 tensor-core products; TMA loads from Hopper on, pointer loads before. Its kernel's first
# builds are the network's too, whose frame attention it serves past a wave: the build plan's early builds.)
ROW = BackendSpec(name="triton", factory=_build, needs=("triton",), min_capability=8, auto_rank=0, reads_fp8=True,
                  fp8_capability=fp8.TRITON_E4M3_CAPABILITY,
                  summary="our range kernel over the page table's runs of rows (Gluon on Hopper): the whole step "
                          "one CUDA graph")
