"""The device side of triton_attention.TileSchedule: which tile, which of its key blocks and which
piece one program of a range kernel takes. Both range kernels (triton_attention's and
gluon_attention's) read the schedule through this one rule, so that the pieces they write are the
ones triton_attention's merge kernel expects."""

from __future__ import annotations

import triton
import triton.language as tl


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
