"""The range attention on Hopper written in Gluon, Triton's lower-level language: two warpgroups per
program take turns on the tensor cores (FlashAttention-3's ping-pong) and a third partition, one warp,
loads keys and values by TMA for both.

Why: the Triton range kernel (triton_attention.py) runs two programs of one warpgroup per SM, and
Triton 3.6 issues each block's products and its softmax one after another. Here each program holds
128 queries of one head (two halves of 64), a warpgroup per half; a half issues block j's q.k^T and
block j-1's p.v asynchronously and computes block j's softmax while they run, its products issued in
turn with the other half's. On a 132-SM Hopper GPU at the streaming shape (1,005 queries, 72,288 keys,
16 heads of 64; the two kernels taking turns for seven rounds) a layer takes 670 us against 726 us
(-7.5 %), at 930 queries 621 against 654; at 1,374 queries, whole tiles in two waves for both,
the same.

The schedule is triton_attention's, on 128-query tiles and one program per SM (the two consumers'
registers, 240 each, fill the register file): whole tiles in waves, the leftover cut into key chunks
whose partial outputs, row maxima and row sums that module's merge kernel combines. The kernel exists
where Gluon's Hopper interface imports (run on Triton 3.6, built for sm_90a by 3.9 as well: a CPU
test builds it with the installed Triton); `available` says whether it does.
"""

from __future__ import annotations

import torch

from .tile_pieces import program_keys, run_after, run_of_block

try:  # Gluon's interface moves between Triton releases; without it the Triton kernel serves alone
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Names that moved: a CTA-wide barrier (`thread_barrier` in Triton 3.6, `barrier` from 3.9 on) and
    # the TMA load (`async_copy_global_to_shared` in 3.6, `async_load` from 3.9 on, same arguments)
    cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed Triton
    gluon = None

# 64 queries a warpgroup (the smallest wgmma M), two warpgroups a program; 128 keys a block; key
# blocks in flight (four: 176 KB of shared memory, one program per SM either way).
HALF_QUERIES, BLOCK_KEYS, KEY_STAGES = 64, 128, 4
TILE_QUERIES = 2 * HALF_QUERIES
# Registers per thread at launch (3 warpgroups share 64K at one program per SM), then per consumer
# warpgroup once the partitions set their own (the loader's keeps 24).
LAUNCH_REGISTERS, CONSUMER_REGISTERS, LOADER_REGISTERS = 168, 240, 24
PROGRAMS_PER_SM = 1  # (the registers above fill an SM's 64K)
HOPPER = 9


def available() -> bool:
    return gluon is not None


def serves(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether this kernel runs the attention of q over keys: bf16, head dimension 64, on Hopper."""
    return (available() and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == HOPPER
            and q.dtype == keys.dtype == torch.bfloat16 and q.shape[-1] == 64)


if gluon is not None:

    @gluon.constexpr_function
    def wgmma_layout(columns):
        """The registers of one warpgroup's wgmma result `columns` wide: scores (a key block wide) or
        outputs (a head wide)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, columns, 16])

    @gluon.jit
    def _masked_scores(s, limit, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
        """Scores of a run's last block, whose keys end `limit` rows in, with the rows past them at -inf."""
        if limit < BLOCK_N:
            keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = gl.where(keys[None, :] < limit, s, gl.full(s.shape, -float("inf"), gl.float32, s_layout))
        return s

    @gluon.jit
    def _softmax_block(s, m_i, l_i, qk_scale):
        """Fold one block's scores into the running max and sum: its probabilities (float32) and the
        factor that rescales what came before."""
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, 1)

    @gluon.jit
    def _take_turn(turn_bars, HALF: gl.constexpr, count, TURNS: gl.constexpr):
        """Wait for this half's `count`-th turn to issue products (half 0 goes first: a fresh barrier
        counts its phase of parity 1 as complete). Without TURNS the halves run freely."""
        if TURNS:
            mbarrier.wait(turn_bars.index(HALF), (count & 1) ^ (1 - HALF))

    @gluon.jit
    def _pass_turn(turn_bars, HALF: gl.constexpr, TURNS: gl.constexpr):
        """The other half's turn: this one has issued its products."""
        if TURNS:
            mbarrier.arrive(turn_bars.index(1 - HALF), count=1)

    @gluon.jit
    def _loader(p, HALF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                TURNS: gl.constexpr):
        """Both halves' queries, then key blocks [first, stop) each into its buffer once both halves
        have released the block STAGES before it."""
        (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tail_smem, q_bar, k_bars, v_bars, empty_bars,
         turn_bars, runs, first, stop, row0, column, Out, stride_o, num_queries, qk_scale,
         partial_out, partial_stats, piece, num_pieces) = p
        present = first < stop
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes, pred=present)
        tma_load(q_desc, [row0, column], q_bar, q_smem.index(0), pred=present)
        tma_load(q_desc, [row0 + BLOCK_M, column], q_bar, q_smem.index(1), pred=present)
        run, run_row, run_keys, run_first = run_of_block(runs, first)
        for i in range(stop - first):
            buffer = i % STAGES
            mbarrier.wait(empty_bars.index(buffer), ((i // STAGES) & 1) ^ 1)  # fresh: passes at parity 1
            run, run_row, run_keys, run_first = run_after(runs, first + i, run, run_row, run_keys, run_first, BLOCK_N)
            row = run_row + (first + i - run_first) * BLOCK_N
            mbarrier.expect(k_bars.index(buffer), k_desc.block_type.nbytes)
            tma_load(k_desc, [row, column], k_bars.index(buffer), k_smem.index(buffer))
            mbarrier.expect(v_bars.index(buffer), v_desc.block_type.nbytes)
            tma_load(v_desc, [row, column], v_bars.index(buffer), v_smem.index(buffer))

    @gluon.jit
    def zeroed_past(values, limit, into, BLOCK_N: gl.constexpr):
        """The key block `values` (shared memory) with its rows from `limit` on zeroed, written to `into`
        (shared memory, may be `values`) and made visible to the warpgroup's products: values past a
        range's end may hold any bits (NaN), and 0 * NaN is NaN."""
        v_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        tail = values.load(v_layout)
        lines = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_layout))
        into.store(gl.where(lines[:, None] < limit, tail, gl.zeros_like(tail)))
        fence_async_shared()
        cta_barrier()
        return into

    @gluon.jit
    def _store_result(acc, m_i, l_i, p, HALF: gl.constexpr, BLOCK_M: gl.constexpr, o_layout: gl.constexpr):
        """A whole tile's normalised rows into Out; a piece's unnormalised rows, maxima and sums into
        partial_out [pieces, 2 * BLOCK_M, D] and partial_stats [2, pieces, 2 * BLOCK_M]."""
        (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tail_smem, q_bar, k_bars, v_bars, empty_bars,
         turn_bars, runs, first, stop, row0, column, Out, stride_o, num_queries, qk_scale,
         partial_out, partial_stats, piece, num_pieces) = p
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        lines = HALF * BLOCK_M + gl.arange(0, BLOCK_M, layout=o_rows)
        dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        if piece < 0:
            rows = row0 + lines
            out = acc / gl.convert_layout(l_i, o_rows)[:, None]
            gl.store(Out + rows[:, None] * stride_o + column + dims[None, :], out.to(Out.dtype.element_ty),
                     mask=rows[:, None] < num_queries)
        else:
            gl.store(partial_out + (piece * 2 * BLOCK_M + lines[:, None]) * HEAD_DIM + dims[None, :], acc)
            gl.store(partial_stats + piece * 2 * BLOCK_M + lines, gl.convert_layout(m_i, o_rows))
            gl.store(partial_stats + (num_pieces + piece) * 2 * BLOCK_M + lines, gl.convert_layout(l_i, o_rows))

    @gluon.jit
    def _consumer(p, HALF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  TURNS: gl.constexpr):
        """One warpgroup: queries [row0 + HALF * BLOCK_M, + BLOCK_M) against key blocks [first, stop)."""
        (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tail_smem, q_bar, k_bars, v_bars, empty_bars,
         turn_bars, runs, first, stop, row0, column, Out, stride_o, num_queries, qk_scale,
         partial_out, partial_stats, piece, num_pieces) = p
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        s_layout: gl.constexpr = wgmma_layout(BLOCK_N)
        o_layout: gl.constexpr = wgmma_layout(HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        m_i = gl.full([BLOCK_M], -float("inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        if first < stop:  # (a piece of a short range may hold no keys: -inf, 0 and 0)
            q_tile = q_smem.index(HALF)
            mbarrier.wait(q_bar, 0)
            s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
            # the first block: its scores now, its p.v with the next block's turn
            mbarrier.wait(k_bars.index(0), 0)
            _take_turn(turn_bars, HALF, 0, TURNS)
            s_token = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            _pass_turn(turn_bars, HALF, TURNS)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s_token, ))
            run, run_row, run_keys, run_first = run_of_block(runs, first)
            s = _masked_scores(s, run_keys - (first - run_first) * BLOCK_N, BLOCK_N, s_layout)
            p_f32, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, qk_scale)
            p_tile = gl.convert_layout(p_f32.to(gl.bfloat16), p_layout)
            for i in range(1, stop - first):
                buffer = i % STAGES
                previous = (i - 1) % STAGES
                mbarrier.wait(k_bars.index(buffer), (i // STAGES) & 1)
                mbarrier.wait(v_bars.index(previous), ((i - 1) // STAGES) & 1)
                _take_turn(turn_bars, HALF, i, TURNS)
                s_token = warpgroup_mma(q_tile, k_smem.index(buffer).permute((1, 0)), s_zero, use_acc=False,
                                        is_async=True)
                acc_token = warpgroup_mma(p_tile, v_smem.index(previous), acc, is_async=True)
                _pass_turn(turn_bars, HALF, TURNS)
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s_token, ))  # (products finish in order)
                # this block's softmax while the previous block's p.v runs
                run, run_row, run_keys, run_first = run_after(runs, first + i, run, run_row, run_keys, run_first,
                                                              BLOCK_N)
                s = _masked_scores(s, run_keys - (first + i - run_first) * BLOCK_N, BLOCK_N, s_layout)
                p_f32, alpha, m_i, l_i = _softmax_block(s, m_i, l_i, qk_scale)
                acc, p_tile = warpgroup_mma_wait(num_outstanding=0, deps=(acc_token, p_tile))
                mbarrier.arrive(empty_bars.index(previous), count=1)  # block i - 1's keys and values read
                acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
                p_tile = gl.convert_layout(p_f32.to(gl.bfloat16), p_layout)
            last = stop - first - 1
            buffer = last % STAGES
            mbarrier.wait(v_bars.index(buffer), (last // STAGES) & 1)
            values = v_smem.index(buffer)
            limit = run_keys - (first + last - run_first) * BLOCK_N  # (the last block's run: the loop ended in it)
            if limit < BLOCK_N:  # (a copy per half: the other half still reads the shared block)
                values = zeroed_past(values, limit, tail_smem.index(HALF), BLOCK_N)
            _take_turn(turn_bars, HALF, stop - first, TURNS)
            acc_token = warpgroup_mma(p_tile, values, acc, is_async=True)
            _pass_turn(turn_bars, HALF, TURNS)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_token, ))
        _store_result(acc, m_i, l_i, p, HALF, BLOCK_M, o_layout)

    # (the schedule's numbers change with the frame size: one compiled kernel serves them all)
    @gluon.jit(do_not_specialize=["whole_tiles", "split_tiles", "splits", "prefix_share"])
    def _pingpong_range_kernel(q_desc, k_desc, v_desc, Out, partial_out, partial_stats, runs, stride_o,
                               num_queries, qk_scale, whole_tiles, split_tiles, splits, prefix_share,
                               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                               TURNS: gl.constexpr, CONSUMER_REGS: gl.constexpr, LOADER_REGS: gl.constexpr):
        """One program: a whole tile of 2 * BLOCK_M queries of one head (program < whole_tiles) or one
        piece of a split tile, as triton_attention's range kernel numbers them (head-major tiles), over the
        key blocks of the run table `runs` (triton_attention.run_table)."""
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        program = gl.program_id(0)
        num_key_blocks = gl.load(runs + 1)
        tile, first, stop, piece = program_keys(program, whole_tiles, split_tiles, splits, prefix_share,
                                                num_key_blocks)
        num_query_blocks = gl.cdiv(num_queries, 2 * BLOCK_M)
        row0 = (tile % num_query_blocks) * 2 * BLOCK_M
        column = (tile // num_query_blocks) * HEAD_DIM

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        tail_smem = gl.allocate_shared_memory(v_desc.dtype, [2, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
            mbarrier.init(empty_bars.index(i), count=2)  # both halves release a buffer
        mbarrier.init(turn_bars.index(0), count=1)
        mbarrier.init(turn_bars.index(1), count=1)
        fence_async_shared()

        p = (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, tail_smem, q_bar, k_bars, v_bars, empty_bars,
             turn_bars, runs, first, stop, row0, column, Out, stride_o, num_queries, qk_scale,
             partial_out, partial_stats, piece, split_tiles * splits)
        gl.warp_specialize([
            (_consumer, (p, 0, BLOCK_M, BLOCK_N, STAGES, TURNS)),
            (_consumer, (p, 1, BLOCK_M, BLOCK_N, STAGES, TURNS)),
            (_loader, (p, 0, BLOCK_M, BLOCK_N, STAGES, TURNS)),
        ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor of a [tokens, H * D] view, blocks of `rows` tokens by one head."""
    flat = t.flatten(1)
    head_dim = t.shape[-1]
    layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [rows, head_dim], layout)


def launch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, runs: torch.Tensor, out: torch.Tensor,
           partial_out: torch.Tensor, partial_stats: torch.Tensor, schedule, qk_scale: float, *,
           stages: int = KEY_STAGES, turns: bool = True) -> None:
    """Run the programs of `schedule` (a triton_attention.TileSchedule on TILE_QUERIES-query tiles):
    q [T, H, D] contiguous, keys/values [capacity, H, D] with each token's heads side by side, the rows
    of the run table `runs` (triton_attention.run_table) read on the device; out [T, H, D]; pieces into partial_out
    [pieces, TILE_QUERIES, D] and partial_stats [2, pieces, TILE_QUERIES] (float32). `stages` (key
    blocks in flight) and `turns` (off: the halves issue their products freely; no faster) are there
    for measurements."""
    _pingpong_range_kernel[(schedule.num_programs,)](
        _descriptor(q, HALF_QUERIES), _descriptor(keys, BLOCK_KEYS), _descriptor(values, BLOCK_KEYS), out,
        partial_out, partial_stats, runs, out.stride(0), q.shape[0], qk_scale, schedule.whole_tiles,
        schedule.split_tiles, schedule.splits, schedule.prefix_share, BLOCK_M=HALF_QUERIES, BLOCK_N=BLOCK_KEYS,
        STAGES=stages, TURNS=turns, CONSUMER_REGS=CONSUMER_REGISTERS, LOADER_REGS=LOADER_REGISTERS, num_warps=4,
        maxnreg=LAUNCH_REGISTERS)
