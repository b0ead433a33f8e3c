"""A library attention kernel in whole waves: the query rows past the last whole wave in a launch
of their own.

PyTorch's flash kernel and cuDNN run one program per block of 128 query rows of one head over
every key, one program per SM (docs/PERFORMANCE.md, 2026-11-25: on an H100 their time at 75,504
keys is flat from 896 to 1,024 rows and jumps 1.5-2.0x at 1,056, where 9 blocks x 16 heads pass
132 SMs). A frame whose blocks need one program more than a wave holds runs a second wave as long
as the first, however few rows it holds: at 518x392 (1,042 tokens, 18 rows past 1,024) a global
layer took 1,991 us through flash and 1,493 through cuDNN against 1,249 and 752 at 518x378.

So the rows of whole waves go to the kernel as they are and the rows left over to a second, small
launch, which cuts the keys into chunks itself: a FlashAttention-2 launch whose blocks would leave
much of the GPU idle runs chunks of the key range side by side and merges them (its split-KV path;
on an H100 at 16 heads up to 832 rows: 922 us at 832 rows, 1,307 at 864 without it), and
FlashInfer's planner splits the keys of a short query range likewise. The 18 rows over 75,504 keys
took 132 us through flash, against a second wave of 1,255 us. Each query row's output is whole
in one of the two launches: nothing to merge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Query rows per program, programs resident per SM, and the compute capability from which that holds,
# of the library kernels the dense backends call at head dim 64 in bf16/fp16, measured on an H100
# (above; FlashInfer's fa2 ragged prefill too: 990-1,020 us from 672 to 1,024 rows, 1,838-1,898 from
# 1,056). PyTorch's flash kernel and FlashInfer's fa2 are FlashAttention-2 kernels, whose tiles at
# head dim 64 are the same on every architecture they run on (8.0 on); below 8.0 SDPA runs the
# memory-efficient kernel instead. cuDNN picks its kernel per architecture: Hopper's measured only.
# FlashInfer's fa3 kernels plan their own split of the keys: flat to 1,536 rows, nothing to cut.
LIBRARY_KERNELS = {"flash": (128, 1, 8), "flashinfer-fa2": (128, 1, 8), "cudnn": (128, 1, 9)}


@dataclass(frozen=True)
class KernelWaves:
    """How a kernel's programs fill the GPU: `block_rows` query rows of one head per program,
    `slots` programs resident at once (SMs x programs per SM)."""

    block_rows: int
    slots: int


def library_waves(kernel: str, device: torch.device | str) -> KernelWaves | None:
    """The waves of library `kernel` (a key of LIBRARY_KERNELS) on `device`; None where they are not
    known (off CUDA, below the kernel's capability, or a kernel not in the table)."""
    device = torch.device(device)
    if device.type != "cuda" or kernel not in LIBRARY_KERNELS:
        return None
    block_rows, per_sm, capability = LIBRARY_KERNELS[kernel]
    if torch.cuda.get_device_capability(device)[0] < capability:
        return None
    return KernelWaves(block_rows, per_sm * torch.cuda.get_device_properties(device).multi_processor_count)


def whole_wave_rows(num_queries: int, num_heads: int, waves: KernelWaves | None) -> int:
    """The query rows, of `num_queries` over `num_heads` heads, that fill whole waves of a kernel of
    `waves`: num_queries itself where nothing is left over (one wave or fewer, whole waves, or
    unknown waves). A wave holds floor(slots / heads) blocks of every head.

    Example, 16 heads on 132 slots of 128-row blocks: 1,042 rows (9 blocks) -> 1,024, 18 left
    over; 1,005 rows (8 blocks, one wave) -> 1,005; 2,048 (16 blocks, two waves) -> 2,048.
    """
    if waves is None:
        return num_queries
    blocks = math.ceil(num_queries / waves.block_rows)
    blocks_per_wave = waves.slots // num_heads
    if blocks_per_wave < 1 or blocks <= blocks_per_wave or blocks % blocks_per_wave == 0:
        return num_queries
    return (blocks - blocks % blocks_per_wave) * waves.block_rows
