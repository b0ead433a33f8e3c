"""A library attention kernel in whole waves: the query rows past the last whole wave in a launch
of their own.

PyTorch's flash kernel and cuDNN run one program per block of 128 query rows of one head over every key, one
program per SM (on 132 SMs their time at 75,504 keys is flat from 896 to 1,024 rows and jumps 1.5-2.0x at
1,056, where 9 blocks x 16 heads pass 132 SMs). A frame whose blocks need one program more than a wave holds
runs a second wave as long as the first, however few rows it holds: at 518x392 (1,042 tokens, 18 rows past
1,024) a global layer takes 1,991 us through flash and 1,493 through cuDNN against 1,249 and 752 at 518x378.

So the rows of whole waves go to the kernel as they are and the rows left over to a second, small
launch, which cuts the keys into chunks itself: a FlashAttention-2 launch whose blocks would leave
much of the GPU idle runs chunks of the key range side by side and merges them (its split-KV path;
on 132 SMs at 16 heads up to 832 rows: 922 us at 832 rows, 1,307 at 864 without it), and
FlashInfer's planner splits the keys of a short query range likewise. The 18 rows over 75,504 keys
take 132 us through flash, against a second wave of 1,255 us. Each query row's output is whole
in one of the two launches: nothing to merge.

Flash's split path is also faster per row than its whole blocks (two programs of 64 rows per SM
against one of 128), so PyTorch's flash kernel gets its rows in launches that each take it: pieces
of as many rows as the path holds (832 at 16 heads on 132 SMs) and the rest. One global layer at
518x322 (857 rows): 838 us as 832 + 25 rows against 1,066 in one launch; at 518x392 1,205 against
1,421 for 1,024 + 18. Equal pieces (2 x 521 rows: 1,365 us) and the small launch on a second stream
beside the large one gain nothing: a launch reads every key, so fewer launches win.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# Query rows per program, programs resident per SM, and the compute capability from which that holds,
# of the library kernels the dense backends call at head dim 64 in bf16/fp16, measured on Hopper
# (above; FlashInfer's fa2 ragged prefill too: 990-1,020 us from 672 to 1,024 rows, 1,838-1,898 from
# 1,056). PyTorch's flash kernel and FlashInfer's fa2 are FlashAttention-2 kernels, whose tiles at
# head dim 64 are the same on every architecture they run on (8.0 on); below 8.0 SDPA runs the
# memory-efficient kernel instead. cuDNN picks its kernel per architecture: Hopper's measured only.
# FlashInfer's fa3 kernels plan their own split of the keys: flat to 1,536 rows, nothing to cut.
LIBRARY_KERNELS = {"flash": (128, 1, 8), "flashinfer-fa2": (128, 1, 8), "cudnn": (128, 1, 9)}
# PyTorch's flash kernel (FlashAttention-2, flash_api.cpp: num_splits_heuristic) splits the keys of a
# launch whose 64-row query blocks of every head number fewer than 0.8 of its 2 programs per SM (the
# comparison in float32, as there).
SPLIT_PATH_KERNELS = ("flash",)
SPLIT_PATH_BLOCK_ROWS = 64


@dataclass(frozen=True)
class KernelWaves:
    """How a kernel's programs fill the GPU: `block_rows` query rows of one head per program,
    `slots` programs resident at once (SMs x programs per SM). A kernel with a split-KV path takes
    it for a launch of fewer than `split_path_blocks` blocks of SPLIT_PATH_BLOCK_ROWS rows over all
    heads (0: no such path)."""

    block_rows: int
    slots: int
    split_path_blocks: float = 0.0


def library_waves(kernel: str, device: torch.device | str) -> KernelWaves | None:
    """The waves of library `kernel` (a key of LIBRARY_KERNELS) on `device`; None where they are not
    known (off CUDA, below the kernel's capability, or a kernel not in the table)."""
    device = torch.device(device)
    if device.type != "cuda" or kernel not in LIBRARY_KERNELS:
        return None
    block_rows, per_sm, capability = LIBRARY_KERNELS[kernel]
    if torch.cuda.get_device_capability(device)[0] < capability:
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return KernelWaves(block_rows, per_sm * sms, flash_split_path_blocks(sms) if kernel in SPLIT_PATH_KERNELS else 0.0)


def flash_split_path_blocks(sms: int) -> float:
    """FlashAttention-2's bound on a launch's query blocks for its split path: 0.8 x 2 programs a
    SM, computed in float32 as the library does (211.2 on 132 SMs)."""
    return float(np.float32(0.8) * np.float32(2 * sms))


def split_path_rows(num_heads: int, waves: KernelWaves | None) -> int:
    """The most query rows over `num_heads` heads that one launch runs on the kernel's split path
    (0: none). Example, flash on 132 SMs at 16 heads: 13 blocks of 64 rows (208 < 211.2), 832."""
    if waves is None or waves.split_path_blocks <= 0:
        return 0
    blocks = math.ceil(waves.split_path_blocks / num_heads) - 1  # the most with num_heads * blocks below the bound
    return SPLIT_PATH_BLOCK_ROWS * max(blocks, 0)


def launch_ends(num_queries: int, num_heads: int, waves: KernelWaves | None) -> tuple[int, ...]:
    """Where the query rows of each launch end, in order, the last at num_queries: on a kernel with
    a split path, pieces of split_path_rows and the rest; otherwise the whole waves' rows and the
    leftover (whole_wave_rows), or one launch.

    Example, flash on 132 SMs at 16 heads: 857 rows -> (832, 857); 1,042 -> (832, 1,042);
    1,900 -> (832, 1,664, 1,900); 820 -> (820,).
    """
    piece = split_path_rows(num_heads, waves)
    if piece > 0:
        return tuple(range(piece, num_queries, piece)) + (num_queries,)
    whole = whole_wave_rows(num_queries, num_heads, waves)
    return (whole, num_queries) if whole < num_queries else (num_queries,)


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
