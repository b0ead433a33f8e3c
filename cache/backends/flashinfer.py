"""FlashInfer's paged prefill over the pages (CUDA only): fa3 on Hopper, fa2 elsewhere.

The pages are FlashInfer's NHD layout, K and V apart: PagedKV.pages(layer) gives k_cache and v_cache
[N, P, H, D] (P = a frame's patch tokens), in bf16/fp16 (FlashInfer has no fp32 kernels, and cannot read our
fp8 pages' per-token scales). RoPE is applied before K is cached, so the kernels run with pos_encoding_mode
"NONE", and without a causal mask (every visible key is attended to).

A step of one frame runs through a wrapper made for CUDA graphs: its page table (indptr, indices, last page
length) lives in buffers of fixed size that `plan` refills between steps, and the kernel reads its schedule
from the wrapper's workspace, so one recorded graph replays every later plan. `plan` runs on the host: it
writes the schedule into a pinned buffer and copies it on the current stream, so before it writes that
buffer again it waits until the last plan's copy has run (a pipelined stream's host runs a frame ahead). A
step of several frames (the scale step, run eagerly) has a wrapper of its own: a graph wrapper's grid is
fixed by its first plan's rows.
"""

from __future__ import annotations

import time

import torch

from ..backend_names import BackendSpec
from ..pages import CacheLayout, VisiblePages
from ..store import PagedKV
from ..streams import DeviceValues

WORKSPACE_BYTES = 128 * 1024 * 1024  # the float workspace both wrappers share (their kernels run one at a time)
HOPPER = 9


def variant_for(device: torch.device) -> str:
    """fa3 (Hopper's kernels, any page size) on a Hopper GPU, fa2 elsewhere."""
    return "fa3" if torch.cuda.get_device_capability(device)[0] == HOPPER else "fa2"


class FlashInferPagedAttention:
    reads_plan_on_device = True  # the one-frame step's wrapper reads its plan from its buffers

    def __init__(self, kv: PagedKV, frame_tokens: int, variant: str):
        # FlashInfer: an optional extra, imported when this backend is built
        import flashinfer

        if kv.device.type != "cuda" or kv.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"FlashInfer needs bf16/fp16 pages on a CUDA device, got {kv.dtype} on {kv.device}")
        self.kv = kv
        self.frame_tokens = frame_tokens  # the rows of a one-frame step, which the graph wrapper takes
        self.variant = variant
        self.name = f"flashinfer-{variant}"
        device, int32 = kv.device, torch.int32
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._indices = DeviceValues(kv.num_pages, int32, device)  # the page table, uploaded without a wait
        self._frame_step = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.zeros(2, dtype=int32, device=device),
            paged_kv_indptr_buf=torch.zeros(2, dtype=int32, device=device),
            paged_kv_indices_buf=torch.zeros(kv.num_pages, dtype=int32, device=device),
            paged_kv_last_page_len_buf=torch.zeros(1, dtype=int32, device=device), backend=variant)
        self._frames_step = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=variant)
        self._planned = self._frame_step
        self._plan_copied = torch.cuda.Event()

    def plan(self, visible: VisiblePages, num_queries: int) -> None:
        wrapper = self._frame_step if num_queries == self.frame_tokens else self._frames_step
        pages = len(visible.page_ids)
        self._indices.set(*visible.page_ids, *[0] * (self.kv.num_pages - pages))
        self._plan_copied.synchronize()  # the pinned schedule buffer is free once the last plan's copy ran
        wrapper.plan(
            torch.tensor([0, num_queries], dtype=torch.int32),
            torch.tensor([0, pages], dtype=torch.int32),
            self._indices.values[:pages],
            torch.tensor([visible.last_page_len], dtype=torch.int32),
            num_qo_heads=self.kv.num_heads,
            num_kv_heads=self.kv.num_heads,
            head_dim_qk=self.kv.head_dim,
            page_size=self.kv.page_size,
            causal=False,
            pos_encoding_mode="NONE",
            q_data_type=self.kv.dtype,
            kv_data_type=self.kv.dtype,
        )
        self._plan_copied.record()
        self._planned = wrapper

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, H, D] -> [T, H, D] in the pages' dtype."""
        return self._planned.run(q.to(self.kv.dtype).contiguous(), self.kv.pages(layer))


def _build(storage: PagedKV, layout: CacheLayout, compile, device: torch.device,
           most_keys: int) -> FlashInferPagedAttention:
    return FlashInferPagedAttention(storage, layout.tokens_per_frame, variant_for(device))


def build_kernels(num_heads: int, head_dim: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """FlashInfer's kernels for attention of `num_heads` heads of `head_dim` in `dtype` on this machine's GPU,
    compiled where its cache lacks them (scripts/setup-env asks for the model's); returns the seconds taken."""
    started = time.perf_counter()
    _build_ahead(torch.device("cuda", torch.cuda.current_device()), dtype, num_heads, head_dim, None)
    return time.perf_counter() - started


def _build_ahead(device: torch.device, dtype: torch.dtype, num_heads: int, head_dim: int, start_thread) -> None:
    """FlashInfer compiles a kernel the first time a machine asks for it (JIT, into ~/.cache/flashinfer): a step
    of two pages asked for here, beside the checkpoint's load, so that the stream's first step finds it built."""
    storage = PagedKV(1, num_heads, head_dim, 16, dtype, device, num_pages=2)
    layout = CacheLayout(patches_per_frame=16, specials_per_frame=0, scale_frames=1, window_frames=1)
    backend = _build(storage, layout, False, device, storage.num_rows)
    visible = VisiblePages(page_ids=(0, 1), last_page_len=16, page_size=16, num_scale_pages=1, num_window_pages=1,
                           num_special_pages=0, num_special_tokens=0)
    for queries in (16, 32):  # both wrappers: a frame's step and a step of several frames
        backend.plan(visible, queries)
        backend.attend(0, torch.zeros(queries, num_heads, head_dim, dtype=dtype, device=device))
    torch.cuda.synchronize(device)


ROW = BackendSpec(name="flashinfer", factory=_build, needs=("flashinfer",), auto_rank=1, build_ahead=_build_ahead,
                  first_use=("its kernels compile on first use on this machine (about 30 s for fa2, 90 s for fa3, "
                             "once: they are kept in ~/.cache/flashinfer)"),
                  summary="FlashInfer's paged prefill over the same page table (fa3 on Hopper, fa2 elsewhere), "
                          "in CUDA graphs")
