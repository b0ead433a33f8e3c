"""The device side of triton_attention.TileSchedule and of the run table: which tile, which of its key blocks
and which piece one program of a range kernel takes, and which run of rows a key block lies in. Both range
kernels (triton_attention's and gluon_attention's) read the schedule and the runs through these rules, so
that the pieces they write are the ones triton_attention's merge kernel expects."""

from __future__ import annotations

import triton
import triton.language as tl

# The run table a kernel reads on the device, int32: [number of runs, key blocks in all, then per run its first
# token row, its rows, its first key block and its first key], the key blocks numbered one run after another
# (a run's last block partial where its rows end before the block does), the keys likewise
# (triton_attention.run_table makes it).
RUN_TABLE_HEAD, RUN_ENTRY = 2, 4
TABLE_HEAD, TABLE_ENTRY = tl.constexpr(RUN_TABLE_HEAD), tl.constexpr(RUN_ENTRY)  # (a kernel reads module constants so)


@triton.jit
def program_keys(program, whole_tiles, split_tiles, splits, prefix_share, num_key_blocks):
    """Program `program`'s tile, its key blocks [first, stop) and its piece (-1 for a whole tile).
    Programs [0, whole_tiles) take whole tiles over every key block; the rest take piece
    program - whole_tiles, that is key chunk piece // split_tiles of tile whole_tiles + piece %
    split_tiles. The chunks are `splits` equal parts, or with prefix_share > 0 a first chunk of that
    share (per mille) of the blocks and `splits` - 1 equal parts of the rest."""
    tile, first, stop, piece = program, num_key_blocks * 0, num_key_blocks, program * 0 - 1
    if program >= whole_tiles:
        piece = program - whole_tiles
        chunk = piece // split_tiles
        tile = whole_tiles + piece % split_tiles
        if prefix_share > 0:
            prefix = num_key_blocks * prefix_share // 1000
            rest = num_key_blocks - prefix
            first = tl.where(chunk == 0, 0, prefix + (chunk - 1) * rest // (splits - 1))
            stop = tl.where(chunk == 0, prefix, prefix + chunk * rest // (splits - 1))
        else:
            first, stop = chunk * num_key_blocks // splits, (chunk + 1) * num_key_blocks // splits
    return tile, first, stop, piece


@triton.jit
def run_of_block(runs, block):
    """The run of the run table `runs` that holds key block `block`: its index, first token row, rows and
    first key block."""
    run = block * 0
    for index in range(1, tl.load(runs)):
        if tl.load(runs + TABLE_HEAD + index * TABLE_ENTRY + 2) <= block:
            run = index
    entry = runs + TABLE_HEAD + run * TABLE_ENTRY
    return run, tl.load(entry), tl.load(entry + 1), tl.load(entry + 2)


@triton.jit
def run_after(runs, block, run, row, keys, first, BLOCK_N: tl.constexpr):
    """(run, row, keys, first) of key block `block` given block - 1's: the same run, or the next one where
    `block` is past the run's blocks (every run holds at least one block)."""
    if block >= first + tl.cdiv(keys, BLOCK_N):
        run += 1
        entry = runs + TABLE_HEAD + run * TABLE_ENTRY
        row, keys, first = tl.load(entry), tl.load(entry + 1), tl.load(entry + 2)
    return run, row, keys, first
