"""Attention over the pages with one Triton kernel, the range kernel (the `triton` backend, backends/triton.py).

A step's keys are the visible pages' token rows. The plan coalesces the page table into a few runs of rows
(VisiblePages.runs: pages side by side in the storage make one run; a frame is one page) and uploads their
run table (run_table) into a fixed device buffer between steps; the kernel reads it, so that one kernel takes
specials and patches, needs no plan per shape, and the whole aggregator step fits in one CUDA graph. Within a
run the key blocks are read as from one range: a run costs one partial key block at its end. On a 132-SM
Hopper GPU at the streaming shape (1,005 queries, 72,840 keys, 16 heads of 64) one range takes 645 us (462
TFLOP/s), against cuDNN's 713 us for the 71,928 patch keys alone. What made the difference: keys and values
loaded by the tensor memory accelerator (pointer loads: 717 us) and 64-row query blocks (128 rows: 745 us).
Exponentials stay float32: the probe's half-precision `ex2.f16x2` variants were slower, their conversions
costing more than the exponentials they save at head dim 64. What bounds it (Nsight Compute at 1,005
tokens): latency, not a unit's throughput: shared memory holds two programs of 4 warps per SM, so each
scheduler has two warps, and on 57 % of cycles neither is ready (issue slots 42 % busy, the tensor pipe 48
%); fewer key blocks in flight for a third program per SM exposed the loads' latency instead (911 us).

Loads. Hopper and newer load keys and values through TMA descriptors; Ampere and Ada (compute capability 8),
which have no TMA, through pointer loads that Triton pipelines with cp.async. On Hopper the pointer loads cost
11 % a layer at 1,005 tokens (717 against 645 us) and 1-5 % a frame from 518x280 to 518x518, and the schedule
below is the same for both: it reads the resident programs of whichever kernel runs.

Schedule. The work is a set of tiles, 64 queries of one head against every visible key, all of
one cost. One program per tile runs in waves of as many programs as the GPU holds at once (2 per
SM: 264 on 132 SMs). At 518x378 a frame is 1,005 tokens, 16 query blocks x 16 heads = 256 tiles:
one wave. At 518x392 it is 1,042 tokens, 17 x 16 = 272 tiles: a second wave of 8 tiles took about
as long as the first (per layer 703 -> 1,320 us; per frame 25.3 -> 40.4 ms). So the tiles that fill
whole waves still run one program each (`whole_tiles`), and the leftover tiles, fewer than a wave,
are cut into `splits` equal chunks of the key range (`split_tiles` x `splits` pieces, one program
each; schedule_tiles picks the count). A piece writes its unnormalised output, row maxima and row
sums; a second, small kernel merges a tile's pieces, all pieces of a few rows at once. At 272 tiles:
264 whole tiles and 8 tiles in 32-33 pieces, 744 us per layer (27.3 ms per frame). Against
the other answers: 128-query tiles (8 warps) were
slower everywhere and took a second wave at 1,042 tokens too (873 us at 1,005, 1,797 at 1,042);
launching the tiles query block first, so that every head's partial last block comes last,
changes nothing by itself (a tile costs the same whatever its rows); with the leftover cut, that
order was up to 11% slower than head-major (954 against 855 us at 1,116 tokens): pieces of one
head's tiles running together read the same keys through L2. A single wave that leaves slots idle
(224 tiles at 518x322 and 518x336, 240 at 518x350) gains nothing from equal chunks, whose every round
costs, but from a long prefix of each tile and a few short pieces of its rest (PREFIX_SHARE): 6-10% a
layer at 224 tiles.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import gluon_attention
from .tile_pieces import RUN_ENTRY, RUN_TABLE_HEAD, TABLE_ENTRY, TABLE_HEAD, program_keys

# The fastest configuration of a probe over 36 (64 query rows per program: 256 programs for the
# 16 heads of a 1,005-token frame, two per SM; keys and values through TMA descriptors).
BLOCK_QUERIES, BLOCK_KEYS, NUM_WARPS, NUM_STAGES = 64, 128, 4, 3
# The compute capability from which keys and values load through TMA descriptors (Hopper); below it,
# through pointers (backends.py: the kernel runs from Ampere on, for bf16 tensor-core products).
TENSOR_MEMORY_CAPABILITY = 9
# Programs per SM the key blocks in flight are chosen for: the kernel is bound by latency, two warps
# per scheduler (two programs of 4 warps per SM); one program leaves each scheduler one warp.
# A block in flight ahead of the one multiplied counts for more than a third program: two stages at
# three programs per SM take 911 us a layer at 1,005 tokens, three stages at two 645.
PROGRAMS_PER_SM = 2
LOG2_E = 1.4426950408889634
# What a round of pieces costs beyond its share of the keys, in key blocks: its programs' start,
# the pipeline's fill and drain, the partial outputs and the merge. Fitted to a probe: each round of
# pieces adds 15-20 us to a layer of 590-650 key blocks
# (about 1.3 us a block), so 12 blocks. It keeps short key ranges (a frame's own 8-11 blocks)
# whole, where a second wave of pieces would cost as much as the wave of whole tiles.
ROUND_COST_BLOCKS = 12
# Pieces in flight at most, per resident program: the partial outputs stay under 4 x 264 x 17 KB
# (18 MB) at 264 resident programs.
MAX_PIECES_PER_SLOT = 4
# Chunks per tile at most: the merge holds one row's pieces at once, 128 x 64 floats over 4 warps.
MAX_SPLITS = 128
# A single wave filled to at most PREFIX_FILL of its slots, whose tiles no equal cut helps (224 and 240 tiles
# of 264: 518x322, 518x336, 518x350), runs each tile as a prefix of PREFIX_SHARE / 1000 of its key blocks,
# launched first, and PREFIX_PIECES - 1 equal pieces of the rest, which fill the idle slots and then the
# prefixes' as they finish. One layer takes 526-538 us against 559-587 whole at 224 tiles (best cuts 4 pieces
# at 850-900, 3 at 700); the engine at 240 tiles (0.91 of a wave) 2-4 % faster a frame with the cut, at 256
# (0.97) 0-2 % slower.
PREFIX_FILL, PREFIX_SHARE, PREFIX_PIECES = 0.92, 875, 4


@dataclass(frozen=True)
class TileSchedule:
    """How the tiles of one call map to programs. Tiles [0, whole_tiles) take one program each
    over all keys; tiles [whole_tiles, whole_tiles + split_tiles) take `splits` programs each,
    one per key chunk, merged afterwards. splits == 1 exactly when split_tiles == 0. The chunks
    are equal, or with prefix_share (per mille, 0 < prefix_share < 1000) the first holds that
    share of the key blocks and the others equal parts of the rest."""

    whole_tiles: int
    split_tiles: int
    splits: int
    prefix_share: int = 0

    @property
    def num_pieces(self) -> int:
        return self.split_tiles * self.splits

    @property
    def num_programs(self) -> int:
        return self.whole_tiles + self.num_pieces


@functools.lru_cache(maxsize=256)  # (called per launch; a frame size asks the same few questions)
def schedule_tiles(num_tiles: int, slots: int, num_key_blocks: int) -> TileSchedule:
    """The schedule of `num_tiles` equal tiles of `num_key_blocks` key blocks each on `slots`
    resident programs: whole waves of whole tiles, then the leftover (num_tiles mod slots) cut into
    the number of key chunks that finishes it soonest. A leftover of `r` tiles in `s` chunks runs
    in ceil(r*s / slots) rounds of ceil(num_key_blocks / s) blocks plus ROUND_COST_BLOCKS each;
    uncut it takes num_key_blocks.

    Where that keeps a single wave whole, a wave filled to at most PREFIX_FILL is cut into a prefix
    and small pieces instead (PREFIX_SHARE; short key ranges stay whole, as above).

    Example, 264 slots and 600 key blocks: 272 tiles -> 264 whole + 8 in 32 chunks (1.05 tile
    times, not 2); 352 tiles -> 264 whole + 88 in 3 chunks (1.35); 256 tiles stay whole (one wave);
    224 tiles -> each a prefix of 525 blocks and 3 pieces of 25.
    """
    if num_tiles < 1 or slots < 1 or num_key_blocks < 1:
        raise ValueError(f"need a tile, a slot and a key block, got {num_tiles}, {slots} and {num_key_blocks}")
    leftover = num_tiles % slots
    if leftover == 0:
        return TileSchedule(num_tiles, 0, 1)

    def leftover_blocks(splits: int) -> int:
        if splits == 1:
            return num_key_blocks
        return math.ceil(leftover * splits / slots) * (math.ceil(num_key_blocks / splits) + ROUND_COST_BLOCKS)

    most = min(num_key_blocks, MAX_SPLITS, max(1, MAX_PIECES_PER_SLOT * slots // leftover))
    splits = min(range(1, most + 1), key=lambda s: (leftover_blocks(s), s))
    if splits > 1:
        return TileSchedule(num_tiles - leftover, leftover, splits)
    rest_per_piece = num_key_blocks * (1000 - PREFIX_SHARE) / 1000 / (PREFIX_PIECES - 1)
    if num_tiles < slots and num_tiles <= PREFIX_FILL * slots and rest_per_piece >= ROUND_COST_BLOCKS:
        return TileSchedule(0, num_tiles, PREFIX_PIECES, PREFIX_SHARE)
    return TileSchedule(num_tiles, 0, 1)


def tensor_memory_loads(device: torch.device) -> bool:
    """Whether the range kernel loads keys and values through TMA descriptors on `device` (Hopper or
    newer) rather than through pointers."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= TENSOR_MEMORY_CAPABILITY


logger = logging.getLogger("stream_recon.cache.triton_attention")

# The longest an asker waits for another thread's build of the same key, and `measure_resident_programs`
# for the frame attention's build beside its own: a build takes 1.1-2.0 s on a fresh machine and
# Triton gives it no limit of its own. Past it, that build has stalled: the asker
# builds its own (a stream waits for no build of another thread's without a limit).
RESIDENT_PROGRAMS_WAIT_S = 60.0

_resident_programs: dict[tuple, int] = {}
_resident_programs_locks: dict[tuple, threading.Lock] = {}  # one build per key, whichever thread asks first
_locks_lock = threading.Lock()


def resident_programs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_stages: int = NUM_STAGES,
                      tma: bool | None = None) -> int:
    """How many programs of the range kernel, compiled for these arguments, the GPU runs at once:
    per SM, the fewest its shared memory, registers and threads allow, times the SMs (0: it does not
    fit one SM). tma: the loads it is compiled with (None: `tensor_memory_loads`)."""
    tma = tensor_memory_loads(q.device) if tma is None else tma
    key = (q.device.index, q.dtype, keys.dtype, q.shape[-1], num_stages, tma)
    if key not in _resident_programs:
        with _locks_lock:
            lock = _resident_programs_locks.setdefault(key, threading.Lock())
        # (other keys' builds go on beside this one)
        if not lock.acquire(timeout=RESIDENT_PROGRAMS_WAIT_S):
            logger.warning("the range kernel's build for %s on another thread did not finish within %g s; this "
                           "thread builds its own", key, RESIDENT_PROGRAMS_WAIT_S)
            return _resident_programs.setdefault(key, _measure_resident_programs(q, keys, values, num_stages, tma))
        try:
            if key not in _resident_programs:
                _resident_programs[key] = _measure_resident_programs(q, keys, values, num_stages, tma)
        finally:
            lock.release()
    return _resident_programs[key]


def key_stages(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tma: bool | None = None) -> int:
    """The key blocks in flight per program of a cache's attention on this GPU (`choose_key_stages`).
    An SM of 228 KB of shared memory (Hopper) holds two programs at NUM_STAGES with either loads, one of 164
    KB (data-centre Ampere) too; the 100 KB SMs of Ampere's and Ada's consumer cards hold two at two stages
    (the pointer-load kernel compiled for sm_80-89 takes 72 KB at three stages, 40 KB at two)."""
    tma = tensor_memory_loads(q.device) if tma is None else tma
    key = (q.device.index, q.dtype, keys.dtype, q.shape[-1], tma)
    if key not in _key_stages:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        stages = choose_key_stages(lambda stages: resident_programs(q, keys, values, stages, tma), sms)
        if stages is None:
            raise RuntimeError(f"the range kernel does not fit an SM of {torch.cuda.get_device_name(q.device)}, "
                               "even with one key block in flight")
        _key_stages[key] = stages
    return _key_stages[key]


_key_stages: dict[tuple, int] = {}


def choose_key_stages(resident_at: Callable[[int], int], sms: int) -> int | None:
    """The most key blocks in flight (NUM_STAGES down to 2) at which `resident_at(stages)` programs
    are PROGRAMS_PER_SM per SM, else the most (down to 1) at which one fits per SM; None where none
    fits. Each count is built once, and fewer only where more fall short."""
    resident: dict[int, int] = {}

    def per_sm(stages: int) -> int:
        if stages not in resident:
            resident[stages] = resident_at(stages)
        return resident[stages] // sms

    for stages in range(NUM_STAGES, 1, -1):
        if per_sm(stages) >= PROGRAMS_PER_SM:
            return stages
    return next((stages for stages in range(NUM_STAGES, 0, -1) if per_sm(stages) >= 1), None)


def range_kernel_name() -> str:
    """The range kernel's name, which Triton's on-disk cache files its builds under (a machine that built it
    has a warm cache: models/builds/kernel_builds.py, `start_builders`)."""
    return _range_attention_kernel.fn.__name__


def measure_resident_programs(device: torch.device, dtype: torch.dtype, num_heads: int, head_dim: int,
                              start_thread: Callable[[Callable[[], None], str], threading.Thread]) -> None:
    """`resident_programs` of both the range kernel's uses (a cache's attention at `key_stages`, a
    frame's own at FRAME_NUM_STAGES) for `dtype` queries and keys on `device`, found now, the two builds
    side by side: on a fresh machine each takes 1-2 s, which a stream's first steps would otherwise wait
    for. Any shapes do: the schedule's numbers are not specialised on. `start_thread(target, name)`
    starts the second build's daemon thread the caller's way (a helper's: the cache knows no helpers)."""
    q = torch.empty(BLOCK_QUERIES, num_heads, head_dim, dtype=dtype, device=device)  # [N, H, D]
    keys = torch.empty(BLOCK_KEYS, num_heads, head_dim, dtype=dtype, device=device)  # [capacity, H, D]
    failed: list[Exception] = []

    def frame_build() -> None:
        _frame_resident_programs(q, keys, failed)

    # A daemon: one stalled in its build holds neither this call (RESIDENT_PROGRAMS_WAIT_S) nor the exit.
    frames = start_thread(frame_build, threading.current_thread().name)
    try:
        key_stages(q, keys, keys)
    finally:
        frames.join(timeout=RESIDENT_PROGRAMS_WAIT_S)
    if frames.is_alive():
        raise TimeoutError(f"the frame attention's build did not finish within {RESIDENT_PROGRAMS_WAIT_S:g} s")
    if failed:
        raise failed[0]


def _frame_resident_programs(q: torch.Tensor, keys: torch.Tensor, failed: list[Exception]) -> None:
    torch.cuda.set_device(q.device)  # (a new thread starts on device 0)
    try:
        resident_programs(q, keys, keys, FRAME_NUM_STAGES)
    except Exception as error:  # raised by the caller's thread
        failed.append(error)


def _measure_resident_programs(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_stages: int,
                               tma: bool) -> int:
    """Per SM, the fewest programs its shared memory, registers and threads allow, times the SMs."""
    kernel = _compiled_range_kernel(q, keys, values, num_stages, tma)
    properties = torch.cuda.get_device_properties(q.device)
    if kernel.metadata.shared > properties.shared_memory_per_block_optin:
        return 0  # (loading it would fail: more shared memory than a block may have)
    kernel._init_handles()  # loads the binary, which reports the registers per thread
    num_warps = kernel.metadata.num_warps
    # CUDA reserves 1 KB of shared memory per block; registers are handed out per warp, 256 at a time
    by_shared = properties.shared_memory_per_multiprocessor // (kernel.metadata.shared + 1024)
    registers_per_warp = -(-kernel.n_regs * 32 // 256) * 256
    by_registers = getattr(properties, "regs_per_multiprocessor", 65536) // (registers_per_warp * num_warps)
    by_threads = properties.max_threads_per_multi_processor // (num_warps * 32)
    return min(by_shared, by_registers, by_threads) * properties.multi_processor_count


@triton.jit
def _fold_block(s, v, m_i, l_i, acc, qk_scale):
    """Fold one block of scores s [M, N] (float32) and values v [N, D] into the running max m_i,
    sum l_i and output acc (base-2 exponentials)."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _key_block(store, offset, column, stride, capacity, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
               TMA: tl.constexpr, MASKED: tl.constexpr):
    """Rows [offset, offset + BLOCK_N) of the store, columns [column, column + HEAD_DIM): through a TMA
    descriptor (rows past the store read 0), or through pointers from `store` (token stride `stride`;
    MASKED: rows past `capacity` read 0, for a block that may end past the store)."""
    # (one return: the compiler traces the code after a constexpr branch that returns.) Triton
    # pipelines the pointer loads only where it knows `stride` a multiple of 16, as the launch's
    # heads * HEAD_DIM is: an unaligned stride compiles to unpipelined loads (24 KB of shared memory
    # against 72 KB at three stages for sm_80).
    if TMA:
        block = store.load([offset, column])
    else:
        lines = tl.arange(0, BLOCK_N)
        first = store + offset.to(tl.int64) * stride + column  # (a store may pass 2^31 elements)
        pointers = first + lines[:, None] * stride + tl.arange(0, HEAD_DIM)[None, :]
        if MASKED:
            block = tl.load(pointers, mask=offset + lines[:, None] < capacity, other=0.0)
        else:
            block = tl.load(pointers)
    return block


@triton.jit
def _attend_key_blocks(q, keys, values, column, start, num_keys, first, stop, m_i, l_i, acc, qk_scale, stride_k,
                       stride_v, capacity, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """q [BLOCK_M, HEAD_DIM] against key blocks [first, stop) of one run of keys (block b: rows start + b *
    BLOCK_N onwards, column `column` of the store), folded into the running max (scaled, base 2) m_i, sum l_i
    and unnormalised output acc, which it returns; an empty interval returns them as they were."""
    last = num_keys // BLOCK_N  # the partial last block's index, if the run has one
    for block in range(first, tl.minimum(stop, last)):
        offset = start + block * BLOCK_N
        k = _key_block(keys, offset, column, stride_k, capacity, HEAD_DIM, BLOCK_N, TMA, False)
        s = tl.dot(q, tl.trans(k))
        v = _key_block(values, offset, column, stride_v, capacity, HEAD_DIM, BLOCK_N, TMA, False)
        m_i, l_i, acc = _fold_block(s, v, m_i, l_i, acc, qk_scale)
    if (first <= last) & (last < stop):  # (last < stop only when the run ends in a partial block)
        inside = last * BLOCK_N + tl.arange(0, BLOCK_N) < num_keys  # its rows past the end belong to other tokens
        offset = start + last * BLOCK_N
        k = _key_block(keys, offset, column, stride_k, capacity, HEAD_DIM, BLOCK_N, TMA, True)
        s = tl.where(inside[None, :], tl.dot(q, tl.trans(k)), -float("inf"))
        v = _key_block(values, offset, column, stride_v, capacity, HEAD_DIM, BLOCK_N, TMA, True)
        v = tl.where(inside[:, None], v, 0.0)
        m_i, l_i, acc = _fold_block(s, v, m_i, l_i, acc, qk_scale)
    return m_i, l_i, acc


@triton.jit
def _attend_runs(q, keys, values, column, runs, first_key, end_key, first, stop, qk_scale, stride_k, stride_v,
                 capacity, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 RUNS_IN_MEMORY: tl.constexpr, TMA: tl.constexpr):
    """q [BLOCK_M, HEAD_DIM] against key blocks [first, stop) of the step's keys: the blocks of its runs one
    after another (the run table `runs` with RUNS_IN_MEMORY, else the one run [first_key, end_key)). Returns
    the running max (scaled, base 2), the sum and the unnormalised output; -inf, 0 and 0 for no block."""
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if RUNS_IN_MEMORY:
        for run in range(tl.load(runs)):
            entry = runs + TABLE_HEAD + run * TABLE_ENTRY
            start, num_keys, run_first = tl.load(entry), tl.load(entry + 1), tl.load(entry + 2)
            low = tl.maximum(first - run_first, 0)
            high = tl.minimum(stop - run_first, tl.cdiv(num_keys, BLOCK_N))
            if low < high:
                m_i, l_i, acc = _attend_key_blocks(q, keys, values, column, start, num_keys, low, high, m_i, l_i,
                                                   acc, qk_scale, stride_k, stride_v, capacity, HEAD_DIM, BLOCK_N, TMA)
    else:
        m_i, l_i, acc = _attend_key_blocks(q, keys, values, column, first_key, end_key - first_key, first, stop, m_i,
                                           l_i, acc, qk_scale, stride_k, stride_v, capacity, HEAD_DIM, BLOCK_N, TMA)
    return m_i, l_i, acc


@triton.jit
def _tile_rows(tile, num_query_blocks, num_heads, TAILS_LAST: tl.constexpr):
    """A tile's head and query block. Head-major by default; TAILS_LAST numbers the tiles query
    block first, so that every head's last (partial) block comes last."""
    if TAILS_LAST:
        return tile % num_heads, tile // num_heads
    return tile // num_query_blocks, tile % num_query_blocks


# (the schedule's numbers change with the frame size: one compiled kernel serves them all)
# (a spare engine's storage has another capacity than the engine's: it must not compile another kernel)
@triton.jit(do_not_specialize=["capacity", "whole_tiles", "split_tiles", "splits", "prefix_share"])
def _range_attention_kernel(Q, keys, values, Out, partial_out, partial_stats, runs, first_key, end_key,
                            stride_q, stride_o, stride_k, stride_v, capacity, num_queries, num_heads, qk_scale,
                            whole_tiles, split_tiles, splits, prefix_share, HEAD_DIM: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RUNS_IN_MEMORY: tl.constexpr,
                            TAILS_LAST: tl.constexpr, TMA: tl.constexpr):
    """One program: a whole tile (program < whole_tiles) or one piece of a split tile. A tile is BLOCK_M
    queries of one head against that head's keys: the runs of rows the run table `runs` lists (with
    RUNS_IN_MEMORY; else the one run [first_key, end_key)), their key blocks numbered one run after another;
    a piece, against one of `splits` chunks of those blocks (equal, or with prefix_share > 0 the first that
    share per mille of them and the others equal parts of the rest). `keys` and `values`: the [capacity,
    heads * HEAD_DIM] rows, as TMA descriptors of BLOCK_N rows by HEAD_DIM (TMA) or as pointers (token strides
    stride_k and stride_v). Pieces write partial_out [pieces, BLOCK_M, HEAD_DIM] (unnormalised) and
    partial_stats [2, pieces, BLOCK_M] (row maxima, scaled base 2, and row sums), piece = chunk * split_tiles
    + (tile - whole_tiles)."""
    program = tl.program_id(0)
    if RUNS_IN_MEMORY:
        num_key_blocks = tl.load(runs + 1)
    else:
        num_key_blocks = tl.cdiv(end_key - first_key, BLOCK_N)
    tile, first, stop, piece = program_keys(program, whole_tiles, split_tiles, splits, prefix_share, num_key_blocks)
    num_query_blocks = tl.cdiv(num_queries, BLOCK_M)
    head, query_block = _tile_rows(tile, num_query_blocks, num_heads, TAILS_LAST)
    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_q + head * HEAD_DIM + dims[None, :], mask=rows[:, None] < num_queries,
                other=0.0)
    m_i, l_i, acc = _attend_runs(q, keys, values, head * HEAD_DIM, runs, first_key, end_key, first, stop, qk_scale,
                                 stride_k, stride_v, capacity, HEAD_DIM, BLOCK_M, BLOCK_N, RUNS_IN_MEMORY, TMA)
    if program < whole_tiles:
        out = acc / l_i[:, None]
        tl.store(Out + rows[:, None] * stride_o + head * HEAD_DIM + dims[None, :], out.to(Out.dtype.element_ty),
                 mask=rows[:, None] < num_queries)
    else:
        lines = tl.arange(0, BLOCK_M)
        tl.store(partial_out + (piece * BLOCK_M + lines[:, None]) * HEAD_DIM + dims[None, :], acc)
        tl.store(partial_stats + piece * BLOCK_M + lines, m_i)
        tl.store(partial_stats + (split_tiles * splits + piece) * BLOCK_M + lines, l_i)


@triton.jit(do_not_specialize=["whole_tiles", "split_tiles", "splits"])
def _merge_pieces_kernel(partial_out, partial_stats, Out, stride_o, num_queries, num_heads, whole_tiles, split_tiles,
                         splits, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                         PIECES: tl.constexpr, TAILS_LAST: tl.constexpr):
    """Program (i, g): rows [g * ROWS, (g + 1) * ROWS) of split tile i, its `splits` pieces
    (PIECES, a power of two, at least `splits`) loaded at once and merged: each weighted by
    2^(its max - the largest max), divided by the weighted sum. A piece without keys (max -inf)
    weighs 0; the last chunk always has keys, so the largest max is finite."""
    index, group = tl.program_id(0), tl.program_id(1)
    chunks = tl.arange(0, PIECES)
    lines = group * ROWS + tl.arange(0, ROWS)
    dims = tl.arange(0, HEAD_DIM)
    piece = chunks * split_tiles + index  # [PIECES]
    present = chunks < splits
    stats = piece[:, None] * BLOCK_M + lines[None, :]  # [PIECES, ROWS]
    maxima = tl.load(partial_stats + stats, mask=present[:, None], other=-float("inf"))
    sums = tl.load(partial_stats + split_tiles * splits * BLOCK_M + stats, mask=present[:, None], other=0.0)
    outs = tl.load(partial_out + stats[:, :, None] * HEAD_DIM + dims[None, None, :], mask=present[:, None, None],
                   other=0.0)  # [PIECES, ROWS, HEAD_DIM]
    weights = tl.math.exp2(maxima - tl.max(maxima, 0)[None, :])
    merged = tl.sum(weights[:, :, None] * outs, 0) / tl.sum(weights * sums, 0)[:, None]
    head, query_block = _tile_rows(whole_tiles + index, tl.cdiv(num_queries, BLOCK_M), num_heads, TAILS_LAST)
    rows = query_block * BLOCK_M + lines
    tl.store(Out + rows[:, None] * stride_o + head * HEAD_DIM + dims[None, :], merged.to(Out.dtype.element_ty),
             mask=rows[:, None] < num_queries)


def run_table(runs: Sequence[tuple[int, int]], max_runs: int) -> list[int]:
    """The run table of `runs` (first token row, rows; each at least one row), room for `max_runs`
    (RUN_TABLE_HEAD + RUN_ENTRY * max_runs values, zeros past the runs)."""
    if not 0 < len(runs) <= max_runs:
        raise ValueError(f"a run table holds 1 to {max_runs} runs, got {len(runs)}")
    table, blocks, keys = [len(runs), 0], 0, 0
    for start, rows in runs:
        table += [start, rows, blocks, keys]
        blocks += -(-rows // BLOCK_KEYS)
        keys += rows
    table[1] = blocks
    return table + [0] * RUN_ENTRY * (max_runs - len(runs))


# The keys a call reads: a run table on q's device (read by the kernels, so that a CUDA graph may record the
# call while the runs change; run_table), or one range of rows (start, end) as two ints.
KeyRuns = torch.Tensor | tuple[int, int]


def attend_range(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_runs: KeyRuns, *,
                 slots: int | None = None, num_stages: int | None = None, schedule_keys: int | None = None,
                 tma: bool | None = None) -> torch.Tensor:
    """Softmax attention of q [T, H, D] over the rows of keys/values [capacity, H, D] that `key_runs` names
    (KeyRuns: a run table, or a range (start, end)). Returns [T, H, D] in q's
    dtype, contiguous. q, keys and values: each token's heads side by side ([*, H, D] with strides
    (any, D, 1)); the runs must hold at least one key. slots: the programs the device runs at
    once, which the schedule fills (None: measured from the compiled kernel on CUDA; one per tile
    elsewhere, where nothing runs side by side). num_stages: key blocks in flight per program (None:
    `key_stages` on CUDA). schedule_keys: the key count the schedule is made for (None: the store's
    capacity): the most a step of the stream reads, so that its schedule stays one for the whole stream (a
    spare engine's, whose storage is smaller, names the full window's). tma: load keys and values through
    TMA descriptors (None: `tensor_memory_loads`).

    With every choice left to it, a run table on the device and bf16 heads of 64 on Hopper, the attention
    runs gluon_attention's kernel (two warpgroups per program taking turns: 7 % faster a layer at
    1,005 queries) on the same schedule."""
    num_queries, num_heads, head_dim = q.shape
    if (slots is None and num_stages is None and tma is None and isinstance(key_runs, torch.Tensor)
            and tensor_memory_loads(q.device) and _pingpong_serves(q, keys) and _pingpong_fills(q)):
        return _attend_range_pingpong(q, keys, values, key_runs, schedule_keys)
    num_tiles = triton.cdiv(num_queries, BLOCK_QUERIES) * num_heads
    tma = tensor_memory_loads(q.device) if tma is None else tma
    if num_stages is None:
        num_stages = key_stages(q, keys, values, tma) if q.is_cuda else NUM_STAGES
    if slots is None:
        slots = resident_programs(q, keys, values, num_stages, tma) if q.is_cuda else num_tiles
    schedule = schedule_tiles(num_tiles, slots, triton.cdiv(schedule_keys or keys.shape[0], BLOCK_KEYS))
    return attend_range_scheduled(q, keys, values, key_runs, slots, schedule=schedule, num_stages=num_stages,
                                  tma=tma)


def attend_range_scheduled(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_runs: KeyRuns,
                           slots: int, *, schedule: TileSchedule | None = None, block_queries: int = BLOCK_QUERIES,
                           num_warps: int = NUM_WARPS, num_stages: int = NUM_STAGES,
                           tails_last: bool = False, tma: bool | None = None) -> torch.Tensor:
    """attend_range on `slots` resident programs; `schedule` (default: schedule_tiles's for the
    store's capacity, which stands for the key count: that one may live on the device), the query
    block, the warps, the tile order and the loads can be forced, for measurements."""
    num_queries, num_heads, head_dim = q.shape
    _check_operands(q, keys, values)
    num_tiles = triton.cdiv(num_queries, block_queries) * num_heads
    if schedule is None:
        schedule = schedule_tiles(num_tiles, slots, triton.cdiv(keys.shape[0], BLOCK_KEYS))
    if schedule.whole_tiles + schedule.split_tiles != num_tiles:
        raise ValueError(f"the schedule covers {schedule.whole_tiles + schedule.split_tiles} tiles, not {num_tiles}")
    out, partial_out, partial_stats = _outputs(q, schedule, block_queries)
    in_memory = isinstance(key_runs, torch.Tensor)
    bounds = (key_runs, 0, 0) if in_memory else (out, *key_runs)  # (the pointer unused without RUNS_IN_MEMORY)
    tma = tensor_memory_loads(q.device) if tma is None else tma
    _range_attention_kernel[(schedule.num_programs,)](
        q, *_key_value_operands(keys, values, tma), out, partial_out, partial_stats, *bounds, q.stride(0),
        out.stride(0), keys.stride(0), values.stride(0), keys.shape[0], num_queries, num_heads,
        head_dim**-0.5 * LOG2_E, schedule.whole_tiles, schedule.split_tiles, schedule.splits, schedule.prefix_share,
        HEAD_DIM=head_dim, BLOCK_M=block_queries, BLOCK_N=BLOCK_KEYS, RUNS_IN_MEMORY=in_memory,
        TAILS_LAST=tails_last, TMA=tma, num_warps=num_warps, num_stages=num_stages)
    _merge_pieces(partial_out, partial_stats, out, schedule, block_queries, tails_last)
    return out


def _check_operands(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
    """The layouts both range kernels read: q [T, H, D] head-contiguous, keys and values [capacity, H, D]
    with each token's heads side by side."""
    num_queries, num_heads, head_dim = q.shape
    if keys.shape[1:] != (num_heads, head_dim) or values.shape != keys.shape:
        raise ValueError(f"keys/values {list(keys.shape)}/{list(values.shape)} do not match queries {list(q.shape)}")
    if any(t.stride(-1) != 1 or t.stride(-2) != head_dim for t in (keys, values)) or q.stride(-1) != 1:
        raise ValueError("attend_range needs head-contiguous queries and [tokens, heads, dim] keys and values "
                         "with each token's heads side by side")


def _outputs(q: torch.Tensor, schedule: TileSchedule, block_queries: int) -> tuple[torch.Tensor, ...]:
    """out [T, H, D] in q's dtype; the pieces' unnormalised outputs [pieces, M, D] and row maxima and
    sums [2, pieces, M] in float32 (one element each when the schedule has no pieces)."""
    num_queries, num_heads, head_dim = q.shape
    out = torch.empty(num_queries, num_heads, head_dim, dtype=q.dtype, device=q.device)
    partial_out = torch.empty(max(1, schedule.num_pieces * block_queries * head_dim), dtype=torch.float32, device=q.device)
    partial_stats = torch.empty(max(1, 2 * schedule.num_pieces * block_queries), dtype=torch.float32, device=q.device)
    return out, partial_out, partial_stats


def _merge_pieces(partial_out: torch.Tensor, partial_stats: torch.Tensor, out: torch.Tensor, schedule: TileSchedule,
                  block_queries: int, tails_last: bool = False) -> None:
    """Each split tile's pieces (partial_out [pieces, block_queries, D], partial_stats [2, pieces,
    block_queries]) merged into its rows of out [T, H, D]."""
    if not schedule.split_tiles:
        return
    num_queries, num_heads, head_dim = out.shape
    pieces = triton.next_power_of_2(schedule.splits)
    rows = max(1, min(block_queries, MERGE_VALUES_PER_ROW_GROUP // pieces))  # a [pieces, rows, D] block per program
    _merge_pieces_kernel[(schedule.split_tiles, block_queries // rows)](
        partial_out, partial_stats, out, out.stride(0), num_queries, num_heads, schedule.whole_tiles,
        schedule.split_tiles, schedule.splits, HEAD_DIM=head_dim, BLOCK_M=block_queries, ROWS=rows, PIECES=pieces,
        TAILS_LAST=tails_last, num_warps=4)


# Devices whose first build of the Gluon kernel failed (a Triton whose Gluon differs): the Triton kernel serves.
_pingpong_failed: set[int] = set()
_pingpong_built: set[int] = set()


def _pingpong_serves(q: torch.Tensor, keys: torch.Tensor) -> bool:
    return q.device.index not in _pingpong_failed and gluon_attention.serves(q, keys)


def _pingpong_slots(device: torch.device) -> int:
    return gluon_attention.PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def _pingpong_tiles(q: torch.Tensor) -> int:
    return triton.cdiv(q.shape[0], gluon_attention.TILE_QUERIES) * q.shape[1]


def _pingpong_fills(q: torch.Tensor) -> bool:
    """Whether the Gluon kernel's 128-query tiles fill its single wave past PREFIX_FILL, or take more
    than one: a single wave filled less (518x280 to 518x336 on 132 SMs: 96-112 programs) runs
    the Triton kernel, whose 64-query tiles fill it better; with the Gluon kernel there the steps
    between neighbouring sizes grow to 12.7-13.8 %."""
    return _pingpong_tiles(q) > PREFIX_FILL * _pingpong_slots(q.device)


def _attend_range_pingpong(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_runs: torch.Tensor,
                           schedule_keys: int | None) -> torch.Tensor:
    """attend_range through gluon_attention's kernel: schedule_tiles on its 128-query tiles, one
    program per SM, the pieces merged by _merge_pieces. Should its first build fail, the Triton
    kernel serves this device from then on (with a warning)."""
    _check_operands(q, keys, values)
    tile_queries = gluon_attention.TILE_QUERIES
    schedule = schedule_tiles(_pingpong_tiles(q), _pingpong_slots(q.device),
                              triton.cdiv(schedule_keys or keys.shape[0], BLOCK_KEYS))
    out, partial_out, partial_stats = _outputs(q, schedule, tile_queries)
    try:
        gluon_attention.launch(q, keys, values, key_runs, out, partial_out, partial_stats, schedule,
                               q.shape[-1]**-0.5 * LOG2_E)
    except Exception as error:  # only a first build: later launches reuse the built kernel
        if q.device.index in _pingpong_built:
            raise
        _pingpong_failed.add(q.device.index)
        warnings.warn(f"the Gluon attention kernel did not build ({type(error).__name__}: {error}); "
                      "the Triton kernel serves instead", RuntimeWarning, stacklevel=2)
        return attend_range(q, keys, values, key_runs, schedule_keys=schedule_keys)
    _pingpong_built.add(q.device.index)
    _merge_pieces(partial_out, partial_stats, out, schedule, tile_queries)
    return out


# The merge loads all pieces of a few rows at once (one memory latency, not one per piece): 128
# (piece, row) pairs of 64 values, 64 registers per thread of 4 warps.
MERGE_VALUES_PER_ROW_GROUP = 128


def attend_frame(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked attention of one sequence over itself, q, k, v [1, H, N, D] (transposed views of
    token-major [1, N, H, D] tensors, as Attention.heads makes them) -> [1, H, N, D], the same kind
    of view. Several sequences (B > 1) go to PyTorch's SDPA, and so does a frame whose tiles of 64
    queries fit one wave of the range kernel's resident programs (264 on 132 SMs).

    The DINO and frame blocks' keys are the frame's own 8-11 blocks of 128. cuDNN's kernel (SDPA's
    choice there) runs 64-query tiles, 264 at once on 132 SMs: 16 us per call at 1,005 tokens, but
    a second wave takes it to 30 us at 1,042 (518x392, 48 calls per frame). The tiles are too short
    to cut into pieces cheaply (ROUND_COST_BLOCKS), so past one wave the range kernel runs them
    with two key blocks in flight instead of three, which shrinks a program's shared memory enough
    for three per SM (396 at once: one wave up to 1,584 tokens): 23 us at 1,042 tokens. Within one
    wave cuDNN stays, faster than that (16 against 20 us at 1,005 tokens)."""
    num_heads, num_tokens = q.shape[1:3]
    if q.shape[0] != 1 or (q.is_cuda and math.ceil(num_tokens / BLOCK_QUERIES) * num_heads
                           <= _one_wave(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1))):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    out = attend_range(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), (0, num_tokens),
                       num_stages=FRAME_NUM_STAGES)  # [N, H, D]
    return out.transpose(0, 1)[None]


# key blocks in flight for a frame past one wave (see attend_frame)
FRAME_NUM_STAGES = 2


def _one_wave(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> int:
    """The tiles of one wave of the range kernel as a cache's attention runs it on this GPU."""
    return resident_programs(q, keys, values, key_stages(q, keys, values))


def _key_value_operands(keys: torch.Tensor, values: torch.Tensor, tma: bool) -> list:
    """The kernel's `keys` and `values`: [capacity, H * D] views, as TMA descriptors of one key block
    by one head, or as they are (pointers)."""
    flat = [t.flatten(1) for t in (keys, values)]
    if not tma:
        return flat
    return [TensorDescriptor(t, list(t.shape), list(t.stride()), [BLOCK_KEYS, keys.shape[-1]]) for t in flat]


def _compiled_range_kernel(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, num_stages: int, tma: bool):
    """The range kernel as `attend_range` launches it for these arguments, compiled, not run (its
    resources decide the schedule; the schedule's numbers are not specialised on, so any do)."""
    num_queries, num_heads, head_dim = q.shape
    num_tiles = triton.cdiv(num_queries, BLOCK_QUERIES) * num_heads
    unused = torch.empty(1, dtype=torch.float32, device=q.device)
    table = torch.zeros(RUN_TABLE_HEAD + RUN_ENTRY, dtype=torch.int32, device=q.device)
    return _range_attention_kernel.warmup(
        q, *_key_value_operands(keys, values, tma), q, unused, unused, table, 0, 0, q.stride(0), q.stride(0),
        keys.stride(0), values.stride(0), keys.shape[0], num_queries, num_heads, 1.0, num_tiles, 0, 1, 0,
        HEAD_DIM=head_dim, BLOCK_M=BLOCK_QUERIES, BLOCK_N=BLOCK_KEYS, RUNS_IN_MEMORY=True, TAILS_LAST=False, TMA=tma,
        num_warps=NUM_WARPS, num_stages=num_stages, grid=(1,))
