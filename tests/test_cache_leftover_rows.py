"""The rows past a library kernel's last whole wave, and flash's rows in pieces of its split path
(cache/leftover_rows.py): where the cuts fall (hypothesis), and the dense backends that cut
computing what they compute uncut (CPU, float64, with small waves standing in for a GPU's)."""

from __future__ import annotations

import math

import pytest
import torch
from cache_reference import exact_attention, stream_split_beside_dense
from hypothesis import given
from hypothesis import strategies as st

from stream_recon.cache import (
    CacheLayout,
    DenseAttention,
    DenseKV,
    SplitCudnnAttention,
    VisibleRange,
    backends,
)
from stream_recon.cache.leftover_rows import (
    KernelWaves,
    flash_split_path_blocks,
    launch_ends,
    library_waves,
    split_path_rows,
    whole_wave_rows,
)

H100_FLASH = KernelWaves(block_rows=128, slots=132)
H100_FLASH_SPLIT = KernelWaves(block_rows=128, slots=132, split_path_blocks=flash_split_path_blocks(132))


@pytest.mark.parametrize(("rows", "expected"), [(746, 746), (1005, 1005), (1024, 1024), (1025, 1024), (1042, 1024),
                                                (1375, 1024), (2048, 2048), (2080, 2048), (3072, 3072), (3073, 3072)])
def test_the_h100_flash_kernel_cuts_past_every_wave_of_1024_rows(rows, expected):
    assert whole_wave_rows(rows, 16, H100_FLASH) == expected


@given(rows=st.integers(1, 20_000), heads=st.integers(1, 64), block_rows=st.integers(1, 256),
       slots=st.integers(1, 600))
def test_whole_waves_hold_whole_blocks_of_every_head_and_leave_less_than_a_wave(rows, heads, block_rows, slots):
    waves = KernelWaves(block_rows, slots)
    whole = whole_wave_rows(rows, heads, waves)
    blocks_per_wave = slots // heads
    assert 0 < whole <= rows
    if whole < rows:
        whole_blocks, all_blocks = whole // block_rows, math.ceil(rows / block_rows)
        assert whole % block_rows == 0 and whole_blocks % blocks_per_wave == 0 and whole_blocks >= blocks_per_wave
        assert 0 < all_blocks - whole_blocks < blocks_per_wave  # the leftover: part of one wave
    else:  # nothing left over: one wave or less, whole waves, or a wave without a block of every head
        blocks = math.ceil(rows / block_rows)
        assert blocks_per_wave == 0 or blocks <= blocks_per_wave or blocks % blocks_per_wave == 0


def test_no_waves_no_cut():
    assert whole_wave_rows(1042, 16, None) == 1042
    assert launch_ends(1042, 16, None) == (1042,) and split_path_rows(16, None) == 0


@pytest.mark.parametrize(("rows", "expected"), [(783, (783,)), (832, (832,)), (833, (832, 833)), (857, (832, 857)),
                                                (1042, (832, 1042)), (1900, (832, 1664, 1900))])
def test_the_h100_flash_kernel_runs_pieces_of_832_rows_on_its_split_path(rows, expected):
    # FlashAttention-2 splits a launch of fewer than 0.8 x 264 = 211.2 blocks of 64 rows: 13 x 16 heads
    assert flash_split_path_blocks(132) == pytest.approx(211.2, abs=1e-4)
    assert split_path_rows(16, H100_FLASH_SPLIT) == 832
    assert launch_ends(rows, 16, H100_FLASH_SPLIT) == expected


@pytest.mark.parametrize(("sms", "heads", "rows"), [(60, 16, 320), (80, 16, 448), (108, 16, 640), (128, 16, 768),
                                                    (132, 8, 1664), (132, 300, 0)])
def test_the_split_path_bound_is_strict_as_the_library_compares_it(sms, heads, rows):
    # 60 and 80 SMs put the bound on a whole number of blocks (96 and 128), which stays unsplit
    assert split_path_rows(heads, KernelWaves(128, sms, flash_split_path_blocks(sms))) == rows


@given(rows=st.integers(1, 20_000), heads=st.integers(1, 64), block_rows=st.integers(1, 256),
       slots=st.integers(1, 600), split_path_blocks=st.sampled_from([0.0, 0.5, 96.0, 211.2, 1000.0]))
def test_launches_cover_the_rows_in_order_and_take_the_split_path_or_whole_waves(rows, heads, block_rows, slots,
                                                                                split_path_blocks):
    waves = KernelWaves(block_rows, slots, split_path_blocks)
    ends = launch_ends(rows, heads, waves)
    sizes = [end - start for start, end in zip((0, *ends[:-1]), ends, strict=True)]
    assert ends[-1] == rows and min(sizes) > 0
    piece = split_path_rows(heads, waves)
    if piece:  # every launch on the split path (fewer blocks of 64 rows than the bound), all but the last whole
        assert all(heads * math.ceil(size / 64) < split_path_blocks for size in sizes)
        assert all(size == piece for size in sizes[:-1]) and sizes[-1] <= piece
    else:
        assert ends == ((rows,) if whole_wave_rows(rows, heads, waves) == rows else (whole_wave_rows(rows, heads, waves), rows))


def test_the_cpu_has_no_waves_and_its_dense_backends_no_cut():
    assert library_waves("flash", "cpu") is None and library_waves("cudnn", "cpu") is None
    layout = CacheLayout(patches_per_frame=3, specials_per_frame=2, scale_frames=2, window_frames=3)
    cache = backends.build(backends.spec("dense"), layout, num_layers=1, num_heads=2, head_dim=4, max_frames=20,
                           dtype=torch.float32, device="cpu")
    assert cache.backend.waves is None


@pytest.mark.parametrize("split_path_blocks", [0.0, 5.0])
def test_dense_attention_in_launches_equals_it_uncut(split_path_blocks):
    kv = DenseKV(1, 2, 8, 300, torch.float64, "cpu")
    kv.store.normal_(generator=torch.Generator().manual_seed(0))
    # 3 blocks of 4 rows a wave at 2 heads: 12 rows; or a split path of 2 blocks of 64 rows at 2 heads (4 < 5)
    waves = KernelWaves(block_rows=4, slots=6, split_path_blocks=split_path_blocks)
    cut, uncut = DenseAttention(kv, waves), DenseAttention(kv)
    generator = torch.Generator().manual_seed(1)
    for rows, visible in [(13, VisibleRange(5, 290, 25)), (24, VisibleRange(0, 7, 3)), (30, VisibleRange(40, 41, 40)),
                          (12, VisibleRange(5, 290, 25)), (300, VisibleRange(5, 290, 25))]:
        q = torch.randn(rows, 2, 8, generator=generator, dtype=torch.float64)
        cut.plan(visible, rows)
        uncut.plan(visible, rows)
        assert cut.launch_ends == launch_ends(rows, 2, waves) and uncut.launch_ends == (rows,)
        torch.testing.assert_close(cut.attend(0, q), uncut.attend(0, q), rtol=0, atol=1e-12)
    if split_path_blocks:  # pieces of 128 rows
        assert launch_ends(300, 2, waves) == (128, 256, 300) and launch_ends(24, 2, waves) == (24,)
    else:  # both cut past their whole waves
        assert launch_ends(13, 2, waves) == (12, 13) and launch_ends(30, 2, waves) == (24, 30)


def rows_each_kernel_took(fixed_shape_waves: KernelWaves, any_shape_waves: KernelWaves, rows: int,
                          seed: int) -> tuple[set[int], set[int]]:
    """Stream SplitCudnnAttention with exact kernels of these waves beside DenseAttention (equal
    outputs, stream_split_beside_dense); the row counts the fixed-shape and any-shape kernels took."""
    fixed_calls, any_calls = set(), set()

    def fixed(q, k, v):
        fixed_calls.add(q.shape[2])
        return exact_attention(q, k, v)

    def any_shape(q, k, v):
        any_calls.add(q.shape[2])
        return exact_attention(q, k, v)

    def split_for(kv, full_patch_tokens):
        return SplitCudnnAttention(kv, full_patch_tokens, fixed, any_shape, fixed_shape_waves=fixed_shape_waves,
                                   any_shape_waves=any_shape_waves)

    stream_split_beside_dense(split_for, seed=seed, rows=rows)
    return fixed_calls, any_calls


def test_split_attention_with_its_leftover_rows_apart_equals_dense_attention_through_a_stream():
    """dense-cudnn's leftover rows go to the any-shape kernel over every key, beside the fixed-shape
    kernel's whole waves, whichever path the step takes."""
    # 5 rows. Fixed shapes: blocks of 2 rows, 2 a wave (4 slots at 2 heads): 4 rows whole, 1 left
    # over. Any shape: blocks of 1 row, 3 a wave: 3 rows whole, 2 left over.
    fixed_calls, any_calls = rows_each_kernel_took(KernelWaves(2, 4), KernelWaves(1, 6), rows=5, seed=2)
    assert fixed_calls == {4}  # the fixed-shape kernel saw the whole waves' rows only
    # the any-shape kernel: whole waves (3) and the leftover (2) before the window fills; after it,
    # the specials of the whole waves' rows (4) and the leftover over every key (1)
    assert any_calls == {3, 2, 4, 1}


def test_split_attention_runs_its_any_shape_rows_in_split_path_pieces_through_a_stream():
    """The any-shape (flash) kernel of dense-cudnn takes its rows in pieces of its split path: all rows
    before the window is full, the leftover past the fixed-shape kernel's whole waves after."""
    # 300 rows. Fixed shapes: blocks of 110 rows, 2 a wave at 2 heads: 220 whole, 80 left over. Any
    # shape: a split path below 3 blocks of 64 rows over 2 heads: pieces of 64 rows.
    any_shape_waves = KernelWaves(1, 6, split_path_blocks=3.0)
    assert split_path_rows(2, any_shape_waves) == 64
    fixed_calls, any_calls = rows_each_kernel_took(KernelWaves(110, 4), any_shape_waves, rows=300, seed=3)
    assert fixed_calls == {220}
    # before the window fills: 4 pieces of 64 and 44; after it: the specials of the whole waves' rows
    # (220) and the leftover's 80 rows as 64 + 16
    assert any_calls == {64, 44, 220, 16}
