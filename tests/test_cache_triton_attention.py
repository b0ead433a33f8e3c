"""The Triton range kernel (the `triton` backend) on the CPU, through Triton's interpreter: the same kernel
source the GPU compiles, run block by block in NumPy, against SDPA over the same keys: over the pages of a
stream (the run tables its page tables make), and over runs cut anywhere with every schedule. The GPU runs
it in tests/test_gpu_fast_path.py against the golden fixtures."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from triton_interpreter import interpret

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

# Streams over pages around the kernel's 128-key blocks: pages shorter than one, pages of a block and a bit,
# a frame's specials straddling two pages; queries a frame's tokens, around the 64-row blocks.
# (patches a frame, specials a frame, scale frames, window frames, dtype, K/V cache)
CASES = [(5, 2, 2, 3, "float32", "auto"), (37, 6, 2, 3, "float16", "auto"), (130, 6, 1, 2, "float32", "auto"),
         (61, 6, 2, 2, "float16", "fp8")]

SCRIPT = textwrap.dedent("""
    import random, sys, torch
    from stream_recon.cache import CacheLayout, backends

    random.seed(0)
    torch.manual_seed(0)
    worst, most_runs = [], 0
    for patches, specials, scale, window, dtype, kv_cache in eval(sys.argv[1]):
        dtype = getattr(torch, dtype)
        layout = CacheLayout(patches_per_frame=patches, specials_per_frame=specials, scale_frames=scale,
                             window_frames=window)
        stored = backends.store_dtype(kv_cache, dtype)
        caches = [backends.build(backends.spec(name), layout, num_layers=2, num_heads=2, head_dim=32, max_frames=30,
                                 dtype=dtype, device="cpu", stored=stored) for name in ("triton", "sdpa")]
        error = 0.0
        for step in range(10):
            defer = step > 0 and random.random() < 0.6
            for cache in caches:
                for _ in range(scale if step == 0 else 1):
                    cache.append(defer_eviction=defer)
            slots = caches[0].pending_slots()
            assert torch.equal(slots, caches[1].pending_slots())
            for layer in range(2):
                k, v = torch.randn(len(slots), 2, 32) * 2, torch.randn(len(slots), 2, 32)
                for cache in caches:
                    cache.write(layer, slots, k, v)
            for cache in caches:
                cache.plan(len(slots))
            most_runs = max(most_runs, len(caches[0].bookkeeping.visible_pages().runs()))
            q = torch.randn(len(slots), 2, 32) * 2
            out, expected = (cache.attend(1, q) for cache in caches)
            assert out.shape == q.shape and out.dtype == dtype
            error = max(error, (out.float() - expected.float()).abs().max().item())
            settle = "rollback" if defer and random.random() < 0.5 else "commit"
            for cache in caches:
                getattr(cache, settle)()
        worst.append(error)
    assert most_runs > 1  # (the cases read several runs)
    print(" ".join(f"{w:.3e}" for w in worst))
""")


@pytest.mark.slow
def test_range_kernel_over_a_streams_pages_matches_the_sdpa_reference():
    errors = [float(x) for x in interpret(SCRIPT, CASES).split()]
    assert len(errors) == len(CASES)
    for case, error in zip(CASES, errors, strict=True):
        # P is rounded to the pages' dtype before the second product, as in any fused kernel
        limit = 5e-3 if case[4] == "float16" else 1e-5
        assert error <= limit, f"{case}: max error {error:.2e}"


def test_mismatched_layouts_are_refused():
    import torch

    from stream_recon.cache.triton_attention import attend_range

    q = torch.zeros(4, 2, 32)
    with pytest.raises(ValueError, match="do not match"):
        attend_range(q, torch.zeros(10, 3, 32), torch.zeros(10, 3, 32), (0, 10))
    with pytest.raises(ValueError, match="head-contiguous"):
        store = torch.zeros(10, 32, 2).transpose(1, 2)  # [10, 2, 32] with the heads innermost
        attend_range(q, store, store, (0, 10))


# The schedule on few slots, so that small cases take every path: whole waves, a leftover cut into
# key chunks (one round of pieces, or several), chunks past the last key block (no keys at all),
# a chunk holding only the partial last block, and the tails-last tile order.
# (queries, heads, start, end, slots, forced schedule (whole, split, splits) or None, tails_last, dtype)
SCHEDULE_CASES = [
    (130, 3, 3, 3 + 3000, 4, None, False, "float32"),  # 9 tiles of 24 key blocks: 8 whole + 1 in 4 chunks
    (65, 2, 0, 385, 3, (3, 1, 3), False, "float16"),  # 4 tiles: 3 whole + 1 in 3 chunks
    (64, 4, 11, 11 + 512, 8, (0, 4, 2), False, "float32"),  # no whole wave: all 4 tiles in 2 chunks
    (127, 2, 2, 2 + 640, 5, (0, 4, 5), True, "float32"),  # 4 tiles in 5 chunks: 20 pieces, 4 rounds
    (63, 3, 9, 9 + 100, 1, (0, 3, 3), False, "float32"),  # one key block in 3 chunks: two are empty
    (129, 2, 1, 1 + 129, 1, (4, 2, 2), True, "float16"),  # chunk 1: only the partial block's one key
    (70, 3, 4, 4 + 1300, 8, (0, 6, 4, 700), False, "float32"),  # a prefix of 7 of 11 blocks, 3 pieces of the rest
    (64, 2, 0, 300, 4, (0, 2, 4, 875), False, "float16"),  # 3 blocks: a prefix of 2, pieces of 0-1 blocks
]
# The rule's own prefix cut: it cuts one only from 288 key blocks (7 tiles on 8 slots over 289 blocks,
# RULE_PREFIX_SHAPE), ~30 s in the interpreter. The rule is asked at that size and the kernel runs the very
# schedule it gave over 21 blocks (a prefix of 18, then pieces of one): the programs take the same paths whatever
# the range's length. On the pointer loads only: the forced prefix cuts above take both loads.
RULE_PREFIX_SHAPE = (64, 7, 5, 5 + 36900, 8)  # queries, heads, start, end, slots


def rule_prefix_case() -> tuple:
    from stream_recon.cache.triton_attention import schedule_tiles

    queries, heads, start, end, slots = RULE_PREFIX_SHAPE
    schedule = schedule_tiles(-(-queries // 64) * heads, slots, -(-(end + 5) // 128))
    assert schedule.whole_tiles == 0 and schedule.prefix_share > 0, schedule  # (the rule cuts a prefix there)
    return (queries, heads, start, start + 2600, slots, dataclasses.astuple(schedule), False, "float32")

SCHEDULE_SCRIPT = textwrap.dedent("""
    import sys, torch
    import torch.nn.functional as F
    from stream_recon.cache.triton_attention import TileSchedule, attend_range_scheduled, run_table, schedule_tiles

    torch.manual_seed(1)
    generator = __import__("random").Random(1)
    worst = []
    for queries, heads, start, end, slots, forced, tails_last, dtype, tma in eval(sys.argv[1]):
        dtype = getattr(torch, dtype)
        store = (torch.randn(2, end + 5, heads, 32) * 2).to(dtype)
        q = (torch.randn(queries, heads, 32) * 2).to(dtype)
        if forced is None:
            tiles = -(-queries // 64) * heads
            assert schedule_tiles(tiles, slots, -(-(end + 5) // 128)).splits > 1  # (the case cuts tiles)
        schedule = TileSchedule(*forced) if forced else None
        # the range cut at up to two places anywhere, its runs in shuffled order: the keys are the same set
        cuts = sorted(generator.sample(range(start + 1, end), min(2, end - start - 1)))
        runs = [(a, b - a) for a, b in zip([start, *cuts], [*cuts, end])]
        generator.shuffle(runs)
        table = torch.tensor(run_table(runs, 4), dtype=torch.int32)
        out = attend_range_scheduled(q, store[0], store[1], table, slots, schedule=schedule, tails_last=tails_last,
                                     tma=tma)
        keys, values = (store[i, start:end].float().transpose(0, 1)[None] for i in (0, 1))
        expected = F.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys, values)[0].transpose(0, 1)
        assert out.shape == q.shape and out.dtype == dtype
        worst.append((out.float() - expected).abs().max().item())
    print(" ".join(f"{w:.3e}" for w in worst))
""")


@pytest.mark.parametrize("tma", [True, False], ids=["tma-loads", "pointer-loads"])
@pytest.mark.slow
def test_scheduled_pieces_merge_to_sdpa_over_the_same_keys(tma):
    """Both loads: TMA descriptors (Hopper on) and pointers (Ampere, Ada), each path's partial last
    block included (a store whose last block ends past its rows: the range ends 5 rows before it), over
    the range cut into runs anywhere (each run's own partial block)."""
    schedule_cases = SCHEDULE_CASES if tma else [*SCHEDULE_CASES, rule_prefix_case()]
    cases = [(*case, tma) for case in schedule_cases]
    errors = [float(x) for x in interpret(SCHEDULE_SCRIPT, cases).split()]
    assert len(errors) == len(schedule_cases)
    for case, error in zip(schedule_cases, errors, strict=True):
        limit = 5e-3 if case[-1] == "float16" else 1e-5
        assert error <= limit, f"{case}: max error {error:.2e}"


# A frame's attention over itself (attend_frame): q, k, v as Attention.heads makes them, transposed
# views of one token-major qkv tensor, the key range given as two ints. (tokens, heads, dtype)
FRAME_CASES = [(70, 2, "float32"), (129, 3, "float16"), (64, 1, "float32")]

FRAME_SCRIPT = textwrap.dedent("""
    import sys, torch
    import torch.nn.functional as F
    from stream_recon.cache.triton_attention import attend_frame

    torch.manual_seed(2)
    worst = []
    for tokens, heads, dtype in eval(sys.argv[1]):
        dtype = getattr(torch, dtype)
        qkv = (torch.randn(1, tokens, 3, heads, 32) * 2).to(dtype)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))  # [1, H, N, D], token stride 3 * H * D
        out = attend_frame(q, k, v)
        expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
        assert out.shape == q.shape and out.dtype == dtype
        worst.append((out.float() - expected).abs().max().item())
    batched = torch.randn(2, 3, 5, 32)  # several sequences: PyTorch's SDPA
    torch.testing.assert_close(attend_frame(batched, batched, batched), F.scaled_dot_product_attention(batched, batched, batched))
    print(" ".join(f"{w:.3e}" for w in worst))
""")


@pytest.mark.slow
def test_frame_attention_matches_sdpa_on_strided_views():
    errors = [float(x) for x in interpret(FRAME_SCRIPT, FRAME_CASES).split()]
    assert len(errors) == len(FRAME_CASES)
    for case, error in zip(FRAME_CASES, errors, strict=True):
        limit = 5e-3 if case[-1] == "float16" else 1e-5
        assert error <= limit, f"{case}: max error {error:.2e}"


def test_a_single_wave_with_idle_slots_is_cut_into_prefixes_and_pieces():
    from stream_recon.cache.triton_attention import PREFIX_PIECES, PREFIX_SHARE, TileSchedule, schedule_tiles

    # 518x322 and 518x336 on an H100: 224 tiles of ~490 key blocks on 264 slots; 518x350: 240 tiles
    assert schedule_tiles(224, 264, 490) == TileSchedule(0, 224, PREFIX_PIECES, PREFIX_SHARE)
    assert schedule_tiles(240, 264, 530) == TileSchedule(0, 240, PREFIX_PIECES, PREFIX_SHARE)
    assert schedule_tiles(256, 264, 600) == TileSchedule(256, 0, 1)  # 0.97 of a wave: the cut measured slower
    assert schedule_tiles(224, 264, 9) == TileSchedule(224, 0, 1)  # a frame's own keys: pieces cost more
    assert schedule_tiles(192, 264, 600).prefix_share == 0  # equal chunks where they help (4 of 150 blocks)


def test_schedule_fills_waves_with_whole_tiles_and_cuts_the_leftover():
    from stream_recon.cache.triton_attention import TileSchedule, schedule_tiles

    # the H100's 264 slots (2 per SM) at 518 wide, ~600 key blocks: 1,005 / 1,042 / 1,375 tokens, 16 heads
    assert schedule_tiles(256, 264, 600) == TileSchedule(256, 0, 1)  # one wave, nothing to balance
    assert schedule_tiles(272, 264, 600) == TileSchedule(264, 8, 32)  # 8 leftover tiles: 256 pieces of 19 blocks
    assert schedule_tiles(352, 264, 600) == TileSchedule(264, 88, 3)
    assert schedule_tiles(528, 264, 600) == TileSchedule(528, 0, 1)  # two whole waves
    assert schedule_tiles(192, 264, 600) == TileSchedule(0, 192, 4)  # 768 pieces in 3 rounds: 0.81 tile times, not 1
    # a frame's own 9 key blocks: pieces would cost more than a second wave of whole tiles
    assert schedule_tiles(272, 264, 9) == TileSchedule(272, 0, 1)


@pytest.mark.parametrize("slots", [1, 3, 8, 132, 264])
@pytest.mark.parametrize("num_key_blocks", [1, 9, 600])
def test_schedule_covers_every_tile_once_and_is_never_slower_than_whole_tiles(slots, num_key_blocks):
    from stream_recon.cache.triton_attention import (
        MAX_PIECES_PER_SLOT,
        MAX_SPLITS,
        PREFIX_PIECES,
        ROUND_COST_BLOCKS,
        schedule_tiles,
    )

    for num_tiles in range(1, 3 * slots + 2):
        schedule = schedule_tiles(num_tiles, slots, num_key_blocks)
        assert schedule.whole_tiles + schedule.split_tiles == num_tiles
        assert (schedule.splits == 1) == (schedule.split_tiles == 0)
        assert schedule.num_pieces <= MAX_PIECES_PER_SLOT * slots and schedule.splits <= min(num_key_blocks, MAX_SPLITS)
        whole_waves = math.ceil(num_tiles / slots) * num_key_blocks  # in key blocks
        if schedule.prefix_share:  # a single wave with idle slots, long prefixes, pieces worth a round
            assert schedule.whole_tiles == 0 and num_tiles < slots and schedule.splits == PREFIX_PIECES
            assert num_key_blocks * (1000 - schedule.prefix_share) / 1000 / (schedule.splits - 1) >= ROUND_COST_BLOCKS
        elif schedule.split_tiles:
            assert schedule.whole_tiles % slots == 0
            rounds = math.ceil(schedule.num_pieces / slots)
            cost = schedule.whole_tiles // slots * num_key_blocks
            cost += rounds * (math.ceil(num_key_blocks / schedule.splits) + ROUND_COST_BLOCKS)
            assert cost < whole_waves


def test_resident_programs_are_measured_once_per_key_whichever_thread_asks_first(monkeypatch):
    """A run measures them early on a thread of its own while the first step may ask too: the second
    asker waits for the build under way instead of making another."""
    import threading
    import time

    import torch

    from stream_recon.cache import triton_attention

    measured = []

    def slow_measure(q, keys, values, num_stages, tma):
        measured.append(num_stages)
        time.sleep(0.2)
        return 132 * num_stages

    monkeypatch.setattr(triton_attention, "_measure_resident_programs", slow_measure)
    monkeypatch.setattr(triton_attention, "_resident_programs", {})
    q = keys = torch.empty(4, 2, 8)
    answers = []
    askers = [threading.Thread(target=lambda: answers.append(triton_attention.resident_programs(q, keys, keys, 3, True)))
              for _ in range(4)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert measured == [3] and answers == [396] * 4
    assert triton_attention.resident_programs(q, keys, keys, 2, True) == 264 and measured == [3, 2]
    assert triton_attention.resident_programs(q, keys, keys, 2, False) == 264 and measured == [3, 2, 2]


def test_resident_programs_of_different_keys_are_built_side_by_side(monkeypatch):
    """The global attention's build and the frame attention's (other stages) do not wait for each other: a
    run's first steps wait for the later of the two, not for their sum."""
    import threading

    import torch

    from stream_recon.cache import triton_attention

    both_building = threading.Barrier(2, timeout=10)  # broken (raises) unless the two builds overlap

    def measure(q, keys, values, num_stages, tma):
        both_building.wait()
        return 132 * num_stages

    monkeypatch.setattr(triton_attention, "_measure_resident_programs", measure)
    monkeypatch.setattr(triton_attention, "_resident_programs", {})
    q = keys = torch.empty(4, 2, 8)
    answers = {}
    askers = [threading.Thread(target=lambda stages=stages: answers.update(
        {stages: triton_attention.resident_programs(q, keys, keys, stages, True)})) for stages in (3, 2)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join()
    assert answers == {3: 396, 2: 264}


# (per-SM programs at 3, 2 and 1 key blocks in flight on 132 SMs -> the stages chosen, and the builds asked for)
@pytest.mark.parametrize(("per_sm", "expected", "asked"), [
    ((2, 3, 4), 3, [3]),  # an H100: two programs at three stages, nothing else built
    ((1, 2, 3), 2, [3, 2]),  # two programs only from two stages down
    ((1, 1, 3), 3, [3, 2]),  # never two with a block in flight: the most stages that fit one
    ((0, 1, 2), 2, [3, 2]),  # a 100 KB SM: one program at two stages, before two at one
    ((0, 0, 2), 1, [3, 2, 1]),  # only one stage fits at all
    ((0, 0, 0), None, [3, 2, 1]),  # nothing fits: the caller says so
])
def test_key_stages_keep_two_programs_per_sm_where_they_can(per_sm, expected, asked):
    from stream_recon.cache.triton_attention import NUM_STAGES, choose_key_stages

    assert NUM_STAGES == 3
    built = []

    def resident_at(stages):
        built.append(stages)
        return per_sm[NUM_STAGES - stages] * 132

    assert choose_key_stages(resident_at, 132) == expected
    assert built == asked


# An H100's shared memory per block (opt-in): 227 KB
HOPPER_SHARED_PER_BLOCK = 232448


@pytest.mark.slow
def test_the_gluon_kernel_builds_for_hopper_with_the_installed_triton():
    """The Hopper kernel (cache/gluon_attention.py) built for sm_90a without a GPU, as the engine
    launches it, by this Triton: Gluon renames its functions between releases (3.9 did twice), and a
    build that fails on the GPU falls back to the slower Triton kernel with a warning only. It must fit
    one program per SM: its shared memory within a block's, no registers past the launch bound,
    nothing spilled."""
    from stream_recon.cache import gluon_attention

    if not gluon_attention.available():
        pytest.skip("this Triton has no Gluon interface for Hopper (the Triton kernel serves there)")
    probe = Path(__file__).resolve().parents[1] / "scripts" / "probes" / "probe_gluon_attention.py"
    done = subprocess.run([sys.executable, str(probe), "--compile-only", "--variants",
                           f"pingpong:{gluon_attention.KEY_STAGES}"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert 0 < built["shared"] <= HOPPER_SHARED_PER_BLOCK
    assert built["registers"] <= gluon_attention.LAUNCH_REGISTERS and built["spill_stores"] == 0


def test_a_run_table_numbers_the_key_blocks_one_run_after_another():
    from stream_recon.cache.triton_attention import run_table

    # runs of 130, 5 and 256 rows: 2 + 1 + 2 key blocks of 128
    assert run_table([(1000, 130), (7, 5), (300, 256)], 4) == [3, 5, 1000, 130, 0, 0, 7, 5, 2, 130, 300, 256, 3, 135,
                                                                0, 0, 0, 0]
    with pytest.raises(ValueError, match="1 to 2 runs"):
        run_table([(0, 1)] * 3, 2)
