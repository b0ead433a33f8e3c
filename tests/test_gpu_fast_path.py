"""The fast streaming path on the GPU: the paged cache with its attention backends and the CUDA-graph replay
of streaming steps, against the golden fixtures and against the eager SDPA reference over the same pages.
Skipped on machines without CUDA."""

from __future__ import annotations

import dataclasses
import gc
import random
import time

import numpy as np
import pytest
import torch
from conftest import build_tiny_model
from golden_utils import GOLDEN, golden_frames
from gpu_golden import BF16_TOLERANCE, SCENARIOS, as_golden, errors, long_stream_tiny_model, stream

from stream_recon.models.supervision import Deadline

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# our range kernel as it runs before Hopper: keys and values through pointer loads, not TMA
POINTER_LOADS = "triton-pointers"
GRAPHED = ["triton", POINTER_LOADS, "flashinfer"]


def backend_named(attention: str, monkeypatch) -> str:
    """The --attention a test parameter stands for; POINTER_LOADS makes this GPU load as Ampere does; a
    FlashInfer test skips where FlashInfer is not installed."""
    if attention == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer is not installed")
    if attention != POINTER_LOADS:
        return attention
    from stream_recon.cache import triton_attention

    monkeypatch.setattr(triton_attention, "TENSOR_MEMORY_CAPABILITY", 99)
    return "triton"


@pytest.mark.parametrize("attention", GRAPHED)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_graphed_path_over_pages_agrees_with_golden_and_the_eager_reference(gpu_model, scenario, attention,
                                                                                monkeypatch):
    attention = backend_named(attention, monkeypatch)
    golden = np.load(GOLDEN / scenario / "outputs.npz")
    fast, engine = stream(gpu_model, torch.bfloat16, attention, **SCENARIOS[scenario])
    assert engine.stats()["attention"].startswith(attention) and engine.stats()["cuda_graphs"]
    assert engine.cache.records_attention  # the attention inside the recorded step
    reference, reference_engine = stream(gpu_model, torch.bfloat16, "sdpa", cuda_graphs=False, **SCENARIOS[scenario])
    assert not reference_engine.stats()["cuda_graphs"]
    fast_errors, between = errors(fast, golden), errors(fast, as_golden(reference))
    print(f"{scenario} {engine.stats()['attention']}: graphs vs golden {fast_errors}; vs sdpa eager {between}")
    assert [p.frame_type for p in fast] == [p.frame_type for p in reference]
    for key, limit in BF16_TOLERANCE.items():
        assert fast_errors[key] <= limit, f"{key}: {fast_errors[key]:.3f} sigma"
        assert between[key] <= limit, f"{key}: {between[key]:.3f} sigma"


@pytest.mark.parametrize("attention", [*GRAPHED, "sdpa"])
def test_graph_replay_equals_the_eager_step(gpu_model, attention, monkeypatch):
    """Same kernels, same order: replaying the recorded step changes nothing but the launch cost (the SDPA
    reference's attention runs between the recorded segments)."""
    attention = backend_named(attention, monkeypatch)
    policy = SCENARIOS["flow"]  # deferred frames, rollbacks and commits all go through replays
    graphed, engine = stream(gpu_model, torch.bfloat16, attention, **policy)
    assert engine.stats()["cuda_graphs"]
    eager, eager_engine = stream(gpu_model, torch.bfloat16, attention, cuda_graphs=False, **policy)
    assert not eager_engine.stats()["cuda_graphs"]
    difference = errors(graphed, as_golden(eager))
    print(f"{attention}: graphs vs eager {difference}")
    assert [p.frame_type for p in graphed] == [p.frame_type for p in eager]
    assert max(difference.values()) <= 1e-2


@pytest.mark.parametrize("attention", GRAPHED)
def test_a_rollback_inside_captured_steps_leaves_no_trace(gpu_model, attention, monkeypatch):
    """interval:2, every step replayed: each keyframe's outputs equal those of a stream that never saw the
    non-keyframes (their pages and special tokens rolled back by page-table edits alone)."""
    from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference

    attention = backend_named(attention, monkeypatch)
    model = prepare_for_inference(gpu_model, "cuda", torch.bfloat16)
    images = [frame.cuda() for frame in golden_frames()]
    kept = [image for i, image in enumerate(images) if i < 3 or (i - 3) % 2 == 0]
    runs = []
    for frames, keyframes in ((images, "interval:2"), (kept, "all")):
        engine = StreamingEngine(model, StreamConfig(scale_frames=3, window=4, attention=attention,
                                                     keyframes=keyframes))
        runs.append([p for frame in frames for p in engine.push(frame)] + engine.finish())
        assert engine.stats()["cuda_graphs"] and engine.stats()["cached_frames"] == len(kept)
    with_drops, only_keyframes = runs
    keyframes = [p for p in with_drops if p.is_keyframe]
    assert len(keyframes) == len(only_keyframes) == len(kept)
    for ours, theirs in zip(keyframes, only_keyframes, strict=True):
        np.testing.assert_array_equal(ours.pose_enc, theirs.pose_enc)
        np.testing.assert_array_equal(ours.depth, theirs.depth)


@pytest.mark.parametrize("attention", ["triton", "flashinfer"])
def test_the_plan_of_the_next_step_changes_none_of_the_outputs_of_the_step_in_flight(attention, monkeypatch):
    """A recorded attention replayed behind a busy stream, the next step planned (another page table, other
    runs) while it has not run yet: its output is the one planned for it, not the next plan's."""
    from stream_recon.cache import CacheLayout, backends

    backend_named(attention, monkeypatch)
    layout = CacheLayout(patches_per_frame=1036, specials_per_frame=6, scale_frames=2, window_frames=6)
    caches = {name: backends.build(backends.spec(name), layout, num_layers=1, num_heads=16, head_dim=64,
                                   max_frames=40, dtype=torch.bfloat16, device="cuda") for name in (attention, "sdpa")}
    generator = torch.Generator(device="cuda").manual_seed(0)
    for _frame in range(12):  # a full window, pages recycled (their order no longer the frames')
        for cache in caches.values():
            cache.append()
        slots = caches["sdpa"].pending_slots()
        k, v = (torch.randn(len(slots), 16, 64, device="cuda", generator=generator).bfloat16() for _ in range(2))
        for cache in caches.values():
            cache.write(0, slots, k, v)
            cache.commit()
    fast, reference = caches[attention], caches["sdpa"]
    q = torch.randn(layout.tokens_per_frame, 16, 64, device="cuda", generator=generator).bfloat16()
    fast.append(defer_eviction=True)
    fast.plan(layout.tokens_per_frame)
    fast.attend(0, q)  # (its first launches outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fast.attend(0, q)
    reference.append(defer_eviction=True)
    reference.plan(layout.tokens_per_frame)
    expected = reference.attend(0, q).float()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # (about 0.1 s of the GPU busy before the replay)
    graph.replay()
    fast.commit()
    for _ in range(3):  # the next step's pages: the oldest window page gone, a new one
        fast.append()
        fast.commit()
    fast.append(defer_eviction=True)
    fast.plan(layout.tokens_per_frame)  # written while the replay above waits behind the sleep
    torch.cuda.synchronize()
    error = ((out.float() - expected).norm() / expected.norm()).item()
    assert error <= 1e-2, f"the step in flight read the next plan: {error:.2e}"


def test_the_pages_stay_put_and_each_page_taken_is_freed_over_2000_frames():
    from stream_recon.models import StreamConfig, StreamingEngine

    engine = StreamingEngine(long_stream_tiny_model(),
                             StreamConfig(scale_frames=8, window=64, keyframes="flow", flow_threshold=0.5))
    image = torch.rand(3, 126, 224, device="cuda")
    memory = {}
    for i in range(2000):
        engine.push(image if i % 3 else torch.rand(3, 126, 224, device="cuda"))
        if i + 1 in (500, 2000):
            memory[i + 1] = torch.cuda.memory_allocated()
    engine.finish()  # pipelined flow keeps the last frame's decision pending: make it
    stats = engine.stats()
    pool = engine.cache.bookkeeping.pool
    assert stats["cuda_graphs"] and stats["patch_frames"] <= 72 and pool.num_pages == pool.max_pages
    bookkeeping = engine.cache.bookkeeping
    held = len(bookkeeping.scale_pages) + len(bookkeeping.window_pages) + len(bookkeeping.special_pages)
    assert pool.num_pages - pool.num_free == held  # every page a rolled-back or evicted frame took is free again
    assert memory[2000] - memory[500] <= 8 * 1024 * 1024  # all storage is allocated up front


@pytest.mark.parametrize("scenario", ["all_keyframes", "flow"])
def test_fastest_configuration_stays_within_the_bf16_tolerance(gpu_model, scenario):
    """auto attention, compiled blocks and CUDA graphs: the default settings on a GPU."""
    golden = np.load(GOLDEN / scenario / "outputs.npz")
    fast, engine = stream(gpu_model, torch.bfloat16, "auto", compile=True, **SCENARIOS[scenario])
    measured = errors(fast, golden)
    print(f"{scenario} {engine.stats()['attention']} compiled: vs golden {measured}")
    assert engine.stats()["cuda_graphs"] and engine.stats()["attention"] == "triton"
    if scenario != "flow":  # bf16 flows may cross the threshold elsewhere than float32 ones
        assert [p.frame_type for p in fast] == golden["frame_type"].tolist()
    for key, limit in BF16_TOLERANCE.items():
        assert measured[key] <= limit, f"{key}: {measured[key]:.3f} sigma"


@pytest.mark.parametrize(("scenario", "attention"), [("all_keyframes", "triton"), ("interval_2", "triton"),
                                                     ("flow", "triton"), ("flow", "flashinfer")])
def test_pipelined_streaming_equals_the_synchronous_one(gpu_model, scenario, attention, monkeypatch):
    """A frame's heads beside the next frame's blocks (and, with flow keyframes, the next frame's
    embedding before the decision, the next plan written while a step's graph runs): same predictions and
    decisions, one push later."""
    attention = backend_named(attention, monkeypatch)
    piped, engine = stream(gpu_model, torch.bfloat16, attention, pipeline=True, **SCENARIOS[scenario])
    assert engine.stats()["cuda_graphs"]
    synchronous, _ = stream(gpu_model, torch.bfloat16, attention, pipeline=False, **SCENARIOS[scenario])
    assert [p.frame_index for p in piped] == [p.frame_index for p in synchronous] == list(range(len(piped)))
    assert [p.frame_type for p in piped] == [p.frame_type for p in synchronous]
    assert max(errors(piped, as_golden(synchronous)).values()) == 0.0
    assert all(np.array_equal(a.image, b.image) for a, b in zip(piped, synchronous, strict=True))


def test_pipelined_push_returns_the_previous_frame_and_finish_the_last():
    from stream_recon.models import (
        StreamConfig,
        StreamingEngine,
        prepare_for_inference,
    )

    model = prepare_for_inference(build_tiny_model(), "cuda", torch.bfloat16)
    engine = StreamingEngine(model, StreamConfig(scale_frames=2, window=3, pipeline=True))
    frames = [torch.rand(3, 126, 224, device="cuda") for _ in range(8)]
    returned = [[p.frame_index for p in engine.push(frame)] for frame in frames]
    # scale frames together, then every streaming frame one push late
    assert returned == [[], [0, 1], [], [2], [3], [4], [5], [6]]
    engine.reset()  # a frame still in flight is not lost: the next call hands it over first
    assert [p.frame_index for p in engine.push(frames[0])] == [7]
    assert [p.frame_index for p in engine.finish()] == [0]  # the new stream's one buffered frame


def test_chunk_rollovers_with_pipelining_emit_what_they_emit_without():
    from stream_recon.models import StreamConfig, prepare_for_inference
    from stream_recon.models.stream.chunked import ChunkedEngine

    model = prepare_for_inference(build_tiny_model(), "cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    frames = [torch.rand(3, 126, 224, generator=generator).cuda() for _ in range(40)]
    runs = {}
    for pipeline in (True, False):
        engine = ChunkedEngine(model, StreamConfig(scale_frames=2, window=4, pipeline=pipeline), chunk_frames=12,
                                overlap=4)
        emitted = [p for frame in frames for p in engine.push(frame)] + engine.finish()
        runs[pipeline] = emitted
        assert engine.rollovers >= 2
    piped, synchronous = runs[True], runs[False]
    assert [(p.frame_index, p.chunk_index) for p in piped] == [(p.frame_index, p.chunk_index) for p in synchronous]
    for a, b in zip(piped, synchronous, strict=True):
        np.testing.assert_array_equal(a.c2w, b.c2w)
        np.testing.assert_array_equal(a.depth, b.depth)


@pytest.mark.parametrize("keyframes", ["all", "flow"])
def test_descriptors_from_recorded_pipelined_steps_equal_the_eager_ones_and_change_nothing_else(keyframes, tmp_path):
    """The descriptor (made where the policy reads the frame's tokens) is made in the hand-over graph from the
    embedding's output, which the next frame's embedding overwrites before the heads run (pipelined, flow): it
    must still be the frame's own."""
    from engine_helpers import DESCRIBED_POLICY, policy_beside

    from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference

    model = prepare_for_inference(build_tiny_model(), "cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(1)
    frames = [torch.rand(3, 126, 224, generator=generator).cuda() for _ in range(12)]

    def stream(spelling: str = keyframes, **settings):
        engine = StreamingEngine(model, StreamConfig(scale_frames=2, window=4, keyframes=spelling,
                                                     flow_threshold=0.5, **settings))
        return [p for frame in frames for p in engine.push(frame)] + engine.finish()

    plain = stream()
    with policy_beside(tmp_path, "described", DESCRIBED_POLICY):
        described = stream(f"described:{keyframes}")
        eager = stream(f"described:{keyframes}", cuda_graphs=False, pipeline=False)
    for ours, theirs, reference in zip(described, plain, eager, strict=True):
        assert ours.frame_index == theirs.frame_index == reference.frame_index and theirs.descriptor is None
        np.testing.assert_array_equal(ours.c2w, theirs.c2w)
        np.testing.assert_array_equal(ours.depth, theirs.depth)
        # the recorded embedding against the eager one: the same kernels, bf16 rounding at most
        np.testing.assert_allclose(ours.descriptor, reference.descriptor, atol=2e-3)
    assert len({p.descriptor.tobytes() for p in described}) == len(frames)  # each frame its own


def split_into_runs(start: int, count: int, pieces: int, seed: int) -> torch.Tensor:
    """The keys [start, start + count) as a run table on the GPU: cut at `pieces - 1` places anywhere, the runs
    in shuffled order (attention does not depend on the keys' order)."""
    from stream_recon.cache.triton_attention import run_table

    generator = random.Random(seed)
    cuts = sorted(generator.sample(range(start + 1, start + count), pieces - 1))
    runs = [(a, b - a) for a, b in zip([start, *cuts], [*cuts, start + count], strict=True)]
    generator.shuffle(runs)
    return torch.tensor(run_table(runs, pieces), dtype=torch.int32, device="cuda")


# 518x322, x350, x378, x392, x518: 224, 240, 256, 272 and 352 tiles of 64
@pytest.mark.parametrize("tokens", [857, 931, 1005, 1042, 1375])
@pytest.mark.parametrize("attention", ["triton", POINTER_LOADS])
def test_range_kernel_past_one_wave_matches_sdpa(tokens, attention, monkeypatch):
    """The global attention at the streaming shape (72 frames of keys, read as five runs) with the H100's
    schedule (prefixes and pieces of a wave with idle slots; one wave of whole tiles; whole tiles and pieces
    merged after them), and a frame's attention over itself (cuDNN within one wave, the range kernel on
    strided views past it), against SDPA in float32 over the same bf16 inputs; with TMA loads and with
    pointer loads."""
    from stream_recon.cache import triton_attention
    from stream_recon.cache.triton_attention import attend_frame, attend_range

    if attention == "triton" and not triton_attention.tensor_memory_loads(torch.device("cuda")):
        pytest.skip("the range kernel's tensor-memory loads need Hopper or newer")
    backend_named(attention, monkeypatch)

    torch.manual_seed(tokens)
    num_keys = 72 * (tokens - 6) + 912
    store = torch.randn(2, num_keys + 200, 16, 64, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(tokens, 16, 64, device="cuda", dtype=torch.bfloat16)
    start = 100
    out = attend_range(q, store[0], store[1], split_into_runs(start, num_keys, 5, tokens))
    keys, values = (store[i, start : start + num_keys].float().transpose(0, 1)[None] for i in (0, 1))
    expected = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys, values)
    global_error = ((out.float().transpose(0, 1)[None] - expected).norm() / expected.norm()).item()
    qkv = torch.randn(1, tokens, 3, 16, 64, device="cuda", dtype=torch.bfloat16)
    frame = [t.transpose(1, 2) for t in qkv.unbind(2)]  # [1, H, N, D] views, as Attention.heads makes them
    expected = torch.nn.functional.scaled_dot_product_attention(*(t.float() for t in frame))
    frame_error = ((attend_frame(*frame).float() - expected).norm() / expected.norm()).item()
    print(f"{tokens} tokens: global {global_error:.2e}, frame {frame_error:.2e} (relative)")
    # bf16 operands: P and the output rounded to bf16 (2^-8 relative)
    assert global_error <= 1e-2 and frame_error <= 1e-2


# 518x350, x378, x392, x518: 128, 128, 144 and 176 tiles of 128 queries
@pytest.mark.parametrize("tokens", [931, 1005, 1042, 1375])
def test_gluon_range_kernel_matches_sdpa_and_the_triton_kernel(tokens):
    """On Hopper the global attention runs the Gluon kernel (two warpgroups taking turns) on its own
    schedule where its tiles fill a wave: whole tiles, and pieces merged after whole waves; over one run
    and over several, it matches SDPA in float32 as the Triton kernel does, ignores NaN past the last run's
    end, and a range far shorter than the store (empty pieces) comes out right."""
    from stream_recon.cache import gluon_attention, triton_attention
    from stream_recon.cache.triton_attention import attend_range

    if not gluon_attention.serves(torch.empty(1, 64, dtype=torch.bfloat16, device="cuda"),
                                  torch.empty(1, 64, dtype=torch.bfloat16, device="cuda")):
        pytest.skip("the Gluon kernel runs on Hopper with Gluon's interface")
    torch.manual_seed(tokens)
    num_keys = 72 * (tokens - 6) + 912
    store = torch.randn(2, num_keys + 300, 16, 64, device="cuda", dtype=torch.bfloat16)
    store[:, 100 + num_keys :] = float("nan")  # past the keys' end (inside the last run's last key block)
    q = torch.randn(tokens, 16, 64, device="cuda", dtype=torch.bfloat16)

    def check(start: int, count: int, runs: int) -> None:
        table = split_into_runs(start, count, runs, tokens + runs)
        if runs > 1:  # the run ending at the NaN rows comes last, whose partial block the kernel zeroes
            host = table.tolist()
            entries = [host[2 + 4 * r: 6 + 4 * r] for r in range(runs)]
            last = max(range(runs), key=lambda r: entries[r][0])
            order = [r for r in range(runs) if r != last] + [last]
            from stream_recon.cache.triton_attention import run_table

            table = torch.tensor(run_table([tuple(entries[r][:2]) for r in order], runs), dtype=torch.int32,
                                 device="cuda")
        out = attend_range(q, store[0], store[1], table)
        assert torch.cuda.current_device() in triton_attention._pingpong_built
        triton_out = attend_range(q, store[0], store[1], table, num_stages=triton_attention.NUM_STAGES)
        keys, values = (store[i, start : start + count].float().transpose(0, 1)[None] for i in (0, 1))
        expected = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(0, 1)[None], keys, values)
        ours = out.float().transpose(0, 1)[None]
        error = ((ours - expected).norm() / expected.norm()).item()
        against_triton = ((out.float() - triton_out.float()).norm() / triton_out.float().norm()).item()
        print(f"{tokens} tokens, keys [{start}, {start + count}) in {runs} runs: {error:.2e} against SDPA, "
              f"{against_triton:.2e} against the Triton kernel")
        assert not torch.isnan(out).any() and error <= 1e-2 and against_triton <= 1e-2

    check(100, num_keys, 1)
    check(100, num_keys, 5)
    check(100 + num_keys - tokens - 5, tokens + 5, 1)  # one frame's keys: the store's schedule cuts it to empty pieces


@pytest.mark.parametrize("store_dtype", ["bfloat16", "float32"])
def test_store_write_kernel_stores_what_index_copy_stores(store_dtype):
    """A layer's K/V write at the streaming shape (1,042 tokens, V a strided view of the block's
    qkv, slots scattered as after window moves), byte for byte against two index_copy_ calls."""
    from stream_recon.cache.triton_store import write

    torch.manual_seed(0)
    qkv = torch.randn(1042, 3, 16, 64, device="cuda", dtype=torch.bfloat16)
    k, v = qkv[:, 1].contiguous(), qkv[:, 2]
    store = torch.randn(2, 80_000, 16, 64, device="cuda").to(getattr(torch, store_dtype))
    expected = store.clone()
    slots = torch.randperm(80_000, device="cuda")[:1042]
    write(store, slots, k, v)
    expected[0].index_copy_(0, slots, k.to(expected.dtype))
    expected[1].index_copy_(0, slots, v.to(expected.dtype))
    assert torch.equal(store, expected)


def test_fused_mlp_gelu_is_as_close_to_float32_as_the_separate_bf16_gelu():
    """cuBLASLt's epilogue (tanh-form GELU) against the separate bf16 layers (erf form), both against
    a float32 erf reference at the streaming shape."""
    import torch.nn.functional as F

    from stream_recon.models.network.fused_gelu import GeluLinear

    torch.manual_seed(0)
    layer = GeluLinear(1024, 4096).cuda().bfloat16()
    x = torch.randn(1005, 1024, device="cuda", dtype=torch.bfloat16)
    weight, bias = layer.weight, layer.bias
    exact = F.gelu(F.linear(x.float(), weight.float(), bias.float()))
    fused = layer(x).float()
    separate = F.gelu(F.linear(x, weight, bias)).float()
    tanh = F.gelu(F.linear(x.float(), weight.float(), bias.float()), approximate="tanh")
    fused_error, separate_error = (fused - exact).abs().max().item(), (separate - exact).abs().max().item()
    print(f"fused {fused_error:.2e}, separate {separate_error:.2e}, fused vs fp32 tanh form "
          f"{(fused - tanh).abs().max().item():.2e}")
    assert fused_error <= 1.1 * separate_error


@pytest.mark.parametrize("order", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_one_loaded_checkpoint_serves_a_float32_and_a_bf16_engine_in_either_order(gpu_model, tmp_path, order):
    """Preparing never converts the loaded model: both precisions keep golden parity, whichever
    engine is built and run first (through a real checkpoint file)."""
    from golden_utils import TOLERANCE

    from stream_recon.models import StreamConfig, StreamingEngine, load_model, prepare_for_inference

    path = tmp_path / "synthetic.pt"
    torch.save(gpu_model.state_dict(), path)
    loaded = load_model(path, device="cpu")
    before = {name: value.clone() for name, value in loaded.state_dict().items()}
    prepared = {name: prepare_for_inference(loaded, "cuda", getattr(torch, name), compile=False) for name in order}
    golden = np.load(GOLDEN / "all_keyframes" / "outputs.npz")
    for name in order:
        engine = StreamingEngine(prepared[name], StreamConfig(scale_frames=3, window=4, attention="sdpa"))
        predictions = [p for frame in golden_frames() for p in engine.push(frame.cuda())] + engine.finish()
        measured = errors(predictions, golden)
        print(f"{order}: {name} vs golden {measured}")
        limits = {key: TOLERANCE for key in measured} if name == "float32" else BF16_TOLERANCE
        for key, limit in limits.items():
            assert measured[key] <= limit, f"{name} {key}: {measured[key]:.2e} sigma"
    assert all(torch.equal(value, before[name]) for name, value in loaded.state_dict().items())
    with pytest.raises(ValueError, match="prepared for bfloat16, not float32"):
        StreamingEngine(prepared["bfloat16"], StreamConfig(), dtype=torch.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cli_on_the_gpu_writes_the_official_outputs(golden_checkpoint, golden_frame_folder, tmp_path, dtype):
    """`stream-recon` as a user runs it, default settings but the precision: float32 within the
    float32 tolerance (no TF32 anywhere, whatever PyTorch's process-wide defaults say), bf16 within
    the fixtures' bf16 tolerances."""
    from golden_utils import TOLERANCE, compare_run_with_golden, run_cli_on_golden_frames

    defaults = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default (conftest turns it off for the engine tests)
    try:
        run_dir = run_cli_on_golden_frames(golden_checkpoint, golden_frame_folder, tmp_path / dtype, "all_keyframes",
                                           "--device", "cuda", "--dtype", dtype)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = defaults
    limits = {key: TOLERANCE for key in ("pose_enc", "c2w", "intrinsics", "depth", "depth_conf")}
    compare_run_with_golden(run_dir, "all_keyframes", limits if dtype == "float32" else BF16_TOLERANCE)


@pytest.mark.parametrize(("pipeline", "keyframes", "small_spare"),
                         [(True, "all", False), (False, "all", False), (True, "flow", False), (False, "flow", False),
                          (True, "all", True), (False, "flow", True)])
def test_a_spare_engine_on_its_own_stream_ends_with_what_rollovers_in_place_emit(pipeline, keyframes, small_spare,
                                                                                 monkeypatch):
    """The next window predicted on a worker thread and a CUDA stream of its own (its graph recorded
    while the stream runs), the stream on a stream of higher priority and provisional frames from the
    closed window while the spare catches up: the same final emissions, bit for bit and in the same
    order, as rollovers done in place; every provisional one before its frame's final one. With a
    small spare, its cache has fewer window slots than the window (the current engine takes its frames
    over, a copy into the store its recorded graphs read)."""
    from stream_recon.models import StreamConfig, prepare_for_inference
    from stream_recon.models.stream import chunked
    from stream_recon.models.stream.chunked import ChunkedEngine
    from stream_recon.models.stream.lookahead import SpareEngine

    model = prepare_for_inference(build_tiny_model(), "cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    window, chunk_frames, count = (10, 20, 90) if small_spare else (4, 14, 60)
    frames = [(255 * torch.rand(3, 126, 224, generator=generator)).to(torch.uint8) for _ in range(count)]
    if small_spare:
        monkeypatch.setattr(chunked, "MAX_PROVISIONAL_AHEAD", 2)
        monkeypatch.setattr(chunked, "MAX_PROVISIONAL", 2)
    config = StreamConfig(scale_frames=2, window=window, pipeline=pipeline, keyframes=keyframes, flow_threshold=1e9,
                          max_gap=2)
    in_flight_at_switches = []
    hand_over = SpareEngine.hand_over

    def noting_hand_over(self, current):
        in_flight_at_switches.append(len(self.engine._in_flight))
        return hand_over(self, current)

    monkeypatch.setattr(SpareEngine, "hand_over", noting_hand_over)
    runs = {}
    for lookahead in (False, True):
        engine = ChunkedEngine(model, config, chunk_frames=chunk_frames, overlap=5, lookahead=lookahead)
        pushes = [engine.push(frame) for frame in frames]
        switches_in_the_stream = len(in_flight_at_switches)
        runs[lookahead] = (pushes + [engine.finish()], engine.stats())
        if lookahead:
            spare = engine._rollover.spare.engine
            assert engine.engine.runner.records and spare.runner.records  # both recorded, once
            assert (spare.cache.layout.allocated_window_slots < window) == small_spare
            assert engine._main_stream.stream.priority < torch.cuda.current_stream().priority
            # its eager kernels on part of the SMs: the green context's stream, handed in as an external one
            assert isinstance(engine._rollover.spare._stream, torch.cuda.ExternalStream)
        engine.close()
    (beside, beside_stats), (in_place, in_place_stats) = runs[True], runs[False]
    assert beside_stats["lookahead"] and beside_stats["rollovers"] == in_place_stats["rollovers"] >= 2
    # a pipelined spare's last frame was delivered on its worker before each switch in the stream
    # (SpareEngine.flush); a stream that ends while the spare catches up switches at its end
    assert in_flight_at_switches[:switches_in_the_stream] == [0] * switches_in_the_stream
    assert beside_stats["rollovers_ahead"] - switches_in_the_stream <= 1
    assert beside_stats["rollovers_ahead"] == beside_stats["rollovers"] <= beside_stats["provisional_frames"]
    finals = [p for push in beside for p in push if not p.provisional]
    assert [(p.frame_index, p.chunk_index) for p in finals] == \
        [(p.frame_index, p.chunk_index) for push in in_place for p in push]
    for a, b in zip(finals, [p for push in in_place for p in push], strict=True):
        for key in ("pose_enc", "c2w", "depth", "depth_conf"):
            np.testing.assert_array_equal(getattr(a, key), getattr(b, key))
    seen_final = set()
    for prediction in (p for push in beside for p in push):
        if prediction.provisional:
            assert prediction.frame_index not in seen_final and np.isfinite(prediction.depth).all()
        else:
            seen_final.add(prediction.frame_index)


def test_a_partitioned_stream_runs_its_kernels_on_its_sms_and_graphs_recorded_elsewhere_on_all():
    """Each program of a kernel notes the SM it ran on (%smid): launched on a stream of 16 SMs, at most
    16 distinct ones (the driver's granularity may round up, to 16 on Hopper); replayed there, a graph
    recorded on a plain stream spreads over the whole device, as the spare's recorded steps do."""
    import triton
    import triton.language as tl

    from stream_recon.models.stream.sm_partition import device_sm_count, partitioned_stream

    @triton.jit
    def note_sm(out, spin):
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [tl.full([1], 0, tl.int32)], dtype=tl.int32,
                                       is_pure=False, pack=1)
        total = tl.zeros([1], tl.float32)
        for i in range(spin):  # long enough that the programs spread over every SM they may use
            total += i * 1e-9
        tl.store(out + tl.program_id(0) + tl.arange(0, 1), sm + (total > 1e9).to(tl.int32))

    device = torch.device("cuda", torch.cuda.current_device())
    programs = 8 * device_sm_count(device)
    out = torch.zeros(programs, dtype=torch.int32, device=device)
    stream = partitioned_stream(device, 16)
    assert stream is not None

    def sms_used(stream, run=lambda: note_sm[(programs,)](out, 20000)):
        out.zero_()
        with torch.cuda.stream(stream):
            run()
        stream.synchronize()
        return len(set(out.tolist()))

    plain = torch.cuda.Stream(device)
    sms_used(plain)  # built outside the graph's capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=plain):
        note_sm[(programs,)](out, 20000)
    assert sms_used(stream) <= 16 < sms_used(plain)
    assert sms_used(stream, graph.replay) > 16


def test_a_pipelined_stream_that_ends_while_the_spare_catches_up_gets_its_last_frame_first(monkeypatch):
    """Pipelined, a push returns the frame before, so the stream's last frame is in flight at its end.
    Where the next window is still catching up then (its spare held back here), the end's first part
    is that frame, provisional, from the closed window, without waiting for the spare; the rest, once
    the spare has caught up, is the next window's, and the whole equals a run with rollovers in place."""
    from engine_helpers import SpareGate

    from stream_recon.models import StreamConfig, prepare_for_inference
    from stream_recon.models.stream.chunked import ChunkedEngine

    model = prepare_for_inference(build_tiny_model(), "cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    frames = [(255 * torch.rand(3, 126, 224, generator=generator)).to(torch.uint8) for _ in range(18)]
    config = StreamConfig(scale_frames=2, window=4)
    reference = ChunkedEngine(model, config, chunk_frames=14, overlap=5, lookahead=False)
    in_place = [p for push in [reference.push(frame) for frame in frames] + [reference.finish()] for p in push]
    reference.close()
    gate = SpareGate(monkeypatch)
    engine = ChunkedEngine(model, config, chunk_frames=14, overlap=5, lookahead=True)
    emitted = [p for frame in frames[:9] for p in engine.push(frame)]
    engine._rollover.spare.wait_until(time.perf_counter() + 60)
    gate.open.clear()
    emitted += [p for frame in frames[9:] for p in engine.push(frame)]  # the window closes at frame 14
    assert engine._rollover.phase.name == "CATCHING_UP" and engine._rollover.spare.backlog > 1
    parts = engine.finish_in_parts()
    first = next(parts)
    assert [(p.frame_index, p.chunk_index, p.provisional) for p in first] == [(17, 0, True)]
    gate.open.set()
    emitted += first + [p for part in parts for p in part]
    finals = [p for p in emitted if not p.provisional]
    assert [(p.frame_index, p.chunk_index) for p in finals] == [(p.frame_index, p.chunk_index) for p in in_place]
    for ours, theirs in zip(finals, in_place, strict=True):
        for key in ("pose_enc", "c2w", "depth", "depth_conf"):
            np.testing.assert_array_equal(getattr(ours, key), getattr(theirs, key))
    engine.close()


def budget_leaving(room: int, model, config, size: tuple[int, int], chunk_frames: int) -> int:
    """The budget under which a ChunkedEngine of `config` made now gives its spare `room` bytes: the budget
    less the CUDA context, what the allocator holds now, what the engine will take by its estimate and the
    margin (models/stream/spare_room.py, room_beside_engine; decided before the engine is set up)."""
    from stream_recon.models.stream.chunked import chunk_stream_config
    from stream_recon.models.stream.memory import CUDA_CONTEXT_BYTES, WORKSPACE_BYTES, estimate_memory
    from stream_recon.models.stream.spare_room import engine_takes

    gc.collect()
    torch.cuda.empty_cache()  # (what the case before held)
    engine = estimate_memory(model, chunk_stream_config(config, chunk_frames, model.config.max_frames), size)
    budget = CUDA_CONTEXT_BYTES + torch.cuda.memory_reserved() + engine_takes(engine) + WORKSPACE_BYTES + room
    assert budget >= engine.total, "the engine alone would be planned differently under this budget"
    return budget


def test_lookahead_is_on_by_default_on_cuda_when_a_second_cache_fits(gpu_model):
    """The full-size model at 518x392 (a second engine's bytes far above the allocator's rounding): a spare
    runs with no budget, not where the budget's room holds half of one, and where it holds one; where it runs,
    its pages lie in the engine's storage."""
    from stream_recon.models import StreamConfig, prepare_for_inference
    from stream_recon.models.stream.chunked import ChunkedEngine
    from stream_recon.models.stream.memory import estimate_memory

    model = prepare_for_inference(gpu_model, "cuda", torch.bfloat16)
    frames = [torch.zeros(3, 392, 518, dtype=torch.uint8) for _ in range(5)]
    config = StreamConfig(scale_frames=2, window=4, max_cached_frames=15)
    second = estimate_memory(model, config, (392, 518)).another_engine
    for room, expected in ((second // 2, False), (second + 256 * 2**20, True), (None, True)):
        budget = None if room is None else budget_leaving(room, model, config, (392, 518), chunk_frames=14)
        engine = ChunkedEngine(model, dataclasses.replace(config, gpu_memory=budget), chunk_frames=14, overlap=5)
        for frame in frames:
            engine.push(frame)
        assert engine.stats()["lookahead"] is expected, budget
        lent = engine.engine.cache.pages_beside
        assert (lent > 0) == expected
        if expected:
            engine._rollover.spare.wait_until(time.perf_counter() + 60)  # its warm-up sets its cache up
            assert engine._rollover.spare.engine.cache.storage is engine.engine.cache.storage
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()  # the next case's process holds what the measured one did


def test_a_spare_that_does_not_fit_with_its_whole_provisional_room_gets_a_smaller_one(gpu_model):
    """The spare's cache holds the frames it takes before the switch: a budget with room for a spare
    of 8 provisional frames (13 window slots of 16), not of 12 or 20 (16 slots), runs one with 8."""
    from stream_recon.models import StreamConfig, prepare_for_inference
    from stream_recon.models.stream.chunked import ChunkedEngine
    from stream_recon.models.stream.memory import estimate_memory

    model = prepare_for_inference(gpu_model, "cuda", torch.bfloat16)
    frames = [torch.zeros(3, 392, 518, dtype=torch.uint8) for _ in range(5)]
    config = StreamConfig(scale_frames=2, window=16, max_cached_frames=41)
    one = estimate_memory(model, config, (392, 518))
    spare = {room: estimate_memory(model, config, (392, 518), window_slots=min(16, 5 + room + 2 - 2)).another_engine
             for room in (8, 12)}
    assert spare[8] < spare[12] <= one.another_engine
    budget = budget_leaving((spare[8] + spare[12]) // 2, model, config, (392, 518), chunk_frames=40)
    engine = ChunkedEngine(model, dataclasses.replace(config, gpu_memory=budget), chunk_frames=40, overlap=5)
    try:
        for frame in frames:
            engine.push(frame)
        assert engine.stats()["lookahead"]
        assert engine._rollover.provisional_room == 8
        engine._rollover.spare.wait_until(time.perf_counter() + 60)  # its warm-up sets its cache up
        spare_cache = engine._rollover.spare.engine.cache
        assert spare_cache.layout.allocated_window_slots == 13
        assert spare_cache.bookkeeping.pool.num_pages == engine.engine.cache.pages_beside
    finally:
        engine.close()


def test_the_streams_scale_step_beside_a_spare_returns_its_blocks_to_the_device(gpu_model):
    """A spare is sized to hold one engine's eager step at a time: the stream's scale step (8 frames of
    518x392 in the full-size model: ~600 MiB of activations) gives its blocks back to the device after
    it, rather than leaving them cached on its stream, where the spare's stream could not take them. (The
    allocator's unused bytes are compared before and after: the weights' segments keep some for good.)"""
    from stream_recon.models import StreamConfig, prepare_for_inference
    from stream_recon.models.stream.chunked import ChunkedEngine

    def unused_outside_graph_pools() -> int:
        torch.cuda.synchronize()
        return sum(s["total_size"] - s["allocated_size"] for s in torch.cuda.memory._snapshot()["segments"]
                   if tuple(s["segment_pool_id"]) == (0, 0))

    model = prepare_for_inference(gpu_model, "cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    frames = [torch.randint(0, 256, (3, 392, 518), dtype=torch.uint8, generator=generator) for _ in range(10)]
    engine = ChunkedEngine(model, StreamConfig(window=16, max_cached_frames=41), chunk_frames=40, overlap=5)
    try:
        engine.warm_up(frames[0])
        assert engine.stats()["lookahead"]
        before = unused_outside_graph_pools()
        for frame in frames[:8]:  # the stream's scale step at the eighth
            engine.push(frame)
        kept = unused_outside_graph_pools() - before
        assert kept < 64 * 2**20, f"{kept / 2**20:.0f} MiB of the scale step's blocks stayed cached"
        for frame in frames[8:]:
            engine.push(frame)
        assert engine.stats()["lookahead"] and engine.stats()["frames"] == 10
    finally:
        engine.close()


@pytest.mark.parametrize("scenario", ["all_keyframes", "flow"])
def test_compiled_code_kept_between_runs_streams_the_same(gpu_model, scenario, tmp_path):
    """The defaults with the compiled code kept under a folder: a first preparation compiles and saves
    every call, a second one (Dynamo reset, as in a new process) loads them all and compiles none, and
    streams bit for bit what the first streamed, within the bf16 tolerance of the golden outputs."""
    golden = np.load(GOLDEN / scenario / "outputs.npz")
    first, engine = stream(gpu_model, torch.bfloat16, "auto", compile=True, artefacts=tmp_path, **SCENARIOS[scenario])
    made = engine.stats()["compiled_code"]
    made.pop("seconds")
    torch._dynamo.reset()
    start = time.perf_counter()
    second, engine = stream(gpu_model, torch.bfloat16, "auto", compile=True, artefacts=tmp_path, **SCENARIOS[scenario])
    print(f"{scenario}: {made} compiled, then {engine.stats()['compiled_code']} in {time.perf_counter() - start:.1f} s")
    assert made["compiled"] >= 10 and made["loaded"] == 0
    kept = engine.stats()["compiled_code"]
    assert (kept["loaded"], kept["compiled"]) == (made["compiled"], 0)
    assert engine.stats()["cuda_graphs"]
    for ours, theirs in zip(first, second, strict=True):
        np.testing.assert_array_equal(ours.depth, theirs.depth)
        np.testing.assert_array_equal(ours.c2w, theirs.c2w)
    measured = errors(second, golden)
    for key, limit in BF16_TOLERANCE.items():
        assert measured[key] <= limit, f"{key}: {measured[key]:.3f} sigma"


@pytest.mark.parametrize("scenario", ["all_keyframes", "flow"])
def test_a_warm_up_compiles_and_records_before_the_stream_and_streams_the_same(gpu_model, scenario):
    """The defaults (compiled, recorded, pipelined), Dynamo reset as in a new process: a warm-up on copies
    of the first frame compiles and records the streaming step; the stream after it compiles nothing
    and records nothing, and streams the golden outputs within the bf16 tolerance, the frame types and,
    frame for frame, what a stream without a warm-up streams (within graph replay against eager steps)."""
    from torch._dynamo.utils import counters

    from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference

    golden = np.load(GOLDEN / scenario / "outputs.npz")
    frames = [frame.cuda() for frame in golden_frames()]
    torch._dynamo.reset()
    model = prepare_for_inference(gpu_model, "cuda", torch.bfloat16, compile=True)
    config = StreamConfig(scale_frames=3, window=4, **SCENARIOS[scenario])
    warm = StreamingEngine(model, config)
    assert warm.slow_first_step
    seconds = warm.warm_up(frames[0])
    recorded, compiled = warm.runner.recorded, counters["stats"]["unique_graphs"]
    assert recorded is not None and compiled >= 10, (recorded, compiled)
    warmed = [p for frame in frames for p in warm.push(frame)] + warm.finish()
    assert warm.runner.recorded is recorded and counters["stats"]["unique_graphs"] == compiled
    cold = StreamingEngine(model, config)
    without = [p for frame in frames for p in cold.push(frame)] + cold.finish()
    print(f"{scenario}: warm-up {seconds}, {compiled} graphs compiled in it; "
          f"vs golden {errors(warmed, golden)}; vs no warm-up {errors(warmed, as_golden(without))}")
    assert [p.frame_type for p in warmed] == [p.frame_type for p in without] == list(golden["frame_type"])
    assert max(errors(warmed, as_golden(without)).values()) <= 1e-2
    for key, limit in BF16_TOLERANCE.items():
        assert errors(warmed, golden)[key] <= limit


@pytest.mark.parametrize("scenario", ["all_keyframes", "flow"])
def test_a_stream_that_steps_eagerly_while_its_code_compiles_beside_it_then_compiled_streams_the_same(
        gpu_model, scenario):
    """A compiled model's engine warmed up and streaming as written (`steps_eagerly`) compiles nothing on its
    thread while CompileWhileStreaming compiles on its own; switched after the fourth streaming frame, it
    records its step again, compiles nothing more, and streams the golden outputs within the bf16 tolerance
    and the frame types of a compiled stream warmed up the usual way."""
    from torch._dynamo.utils import counters

    from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference
    from stream_recon.models.builds.while_streaming import CompileWhileStreaming

    golden = np.load(GOLDEN / scenario / "outputs.npz")
    frames = [frame.cuda() for frame in golden_frames()]
    torch._dynamo.reset()
    model = prepare_for_inference(gpu_model, "cuda", torch.bfloat16, compile=True)
    config = StreamConfig(scale_frames=3, window=4, **SCENARIOS[scenario])
    engine = StreamingEngine(model, config)
    engine.steps_eagerly(True)
    before = counters["stats"]["unique_graphs"]  # (the process's count since its start)
    engine.warm_up(frames[0])
    eager_graph = engine.runner.recorded
    assert eager_graph is not None and counters["stats"]["unique_graphs"] == before  # as written: none compiled
    making = CompileWhileStreaming(model, engine.steps_config, frames[0])
    switch_at = config.scale_frames + 4
    predictions = [p for frame in frames[:switch_at] for p in engine.push(frame)]
    making.end(Deadline(300.0))
    compiled = counters["stats"]["unique_graphs"]
    assert making.ready and making.helper.is_up and compiled >= before + 10, (before, compiled)
    engine.steps_eagerly(False)
    predictions += [p for frame in frames[switch_at:] for p in engine.push(frame)] + engine.finish()
    assert engine.runner.recorded is not None and engine.runner.recorded is not eager_graph
    assert counters["stats"]["unique_graphs"] == compiled  # the run's thread compiled nothing of its own
    usual = StreamingEngine(model, config)
    usual.warm_up(frames[0])
    reference = [p for frame in frames for p in usual.push(frame)] + usual.finish()
    print(f"{scenario}: compiled beside in {making.seconds} s; vs golden {errors(predictions, golden)}; "
          f"vs compiled {errors(predictions, as_golden(reference))}")
    assert [p.frame_type for p in predictions] == [p.frame_type for p in reference] == list(golden["frame_type"])
    for key, limit in BF16_TOLERANCE.items():
        assert errors(predictions, golden)[key] <= limit


def chunked_rollover_stream(compile: bool):
    """The tiny model prepared for bf16 on the GPU, 60 noise frames and a flow config that makes a keyframe
    every third frame: with chunk_frames=14, overlap=5, a stream of several rollovers ahead."""
    from stream_recon.models import StreamConfig, prepare_for_inference

    model = prepare_for_inference(build_tiny_model(), "cuda", torch.bfloat16, compile=compile)
    generator = torch.Generator().manual_seed(0)
    frames = [(255 * torch.rand(3, 126, 224, generator=generator)).to(torch.uint8) for _ in range(60)]
    return model, frames, StreamConfig(scale_frames=2, window=4, keyframes="flow", flow_threshold=1e9, max_gap=2)


def test_a_warm_up_starts_the_spare_recorded_and_rollovers_emit_the_same():
    """ChunkedEngine's warm-up on CUDA also starts the next chunk's spare engine and waits while it records
    its step, so the stream's first frames share the device with no warm-up; the final emissions are those
    of a stream without a warm-up (within graph replay against the eager first streaming step)."""
    from stream_recon.models.stream.chunked import ChunkedEngine

    model, frames, config = chunked_rollover_stream(compile=False)
    finals = {}
    for warm in (True, False):
        engine = ChunkedEngine(model, config, chunk_frames=14, overlap=5)
        try:
            if warm:
                seconds = engine.warm_up(frames[0])
                spare = engine._rollover.spare.engine
                assert seconds["spare_s"] > 0 and spare.runner.records and engine.engine.runner.records
                recorded = (engine.engine.runner.recorded, spare.runner.recorded)
            pushes = [engine.push(frame) for frame in frames] + [engine.finish()]
            stats = engine.stats()
            assert stats["lookahead"] and stats["rollovers"] == stats["rollovers_ahead"] >= 2
            if warm:
                assert (engine.engine.runner.recorded, engine._rollover.spare.engine.runner.recorded) == recorded
        finally:
            engine.close()
        finals[warm] = [p for push in pushes for p in push if not p.provisional]
    assert [(p.frame_index, p.chunk_index, p.frame_type) for p in finals[True]] == \
        [(p.frame_index, p.chunk_index, p.frame_type) for p in finals[False]]
    assert max(errors(finals[True], as_golden(finals[False])).values()) <= 1e-2


def test_a_chunked_stream_switched_to_compiled_steps_records_its_spare_again_before_the_rollover():
    """ChunkedEngine stepping as written, its spare warmed so: switched once the compiled code is made, its
    engine and its idle spare record their steps again (the spare on its worker, before the rollover), and the
    final emissions are those of a compiled stream warmed up the usual way."""
    from stream_recon.models.builds.while_streaming import CompileWhileStreaming
    from stream_recon.models.stream.chunked import ChunkedEngine

    torch._dynamo.reset()
    model, frames, config = chunked_rollover_stream(compile=True)
    finals = {}
    for switched in (True, False):
        engine = ChunkedEngine(model, config, chunk_frames=14, overlap=5)
        try:
            engine.steps_eagerly(switched)
            engine.warm_up(frames[0])
            if switched:
                eager_graphs = (engine.engine.runner.recorded, engine._rollover.spare.engine.runner.recorded)
                making = CompileWhileStreaming(model, engine.steps_config, frames[0])
                making.end(Deadline(300.0))
                assert making.ready
                streaming = config.scale_frames + 1  # (the scale frames, then one streaming step as written)
                pushes = [engine.push(frame) for frame in frames[:streaming]]
                engine.steps_eagerly(False)
                pushes += [engine.push(frames[streaming])]  # the engine records its step again...
                assert engine.engine.runner.recorded not in (None, eager_graphs[0])
                assert engine._rollover.spare.engine.eager_steps  # ...the spare only after it:
                pushes += [engine.push(frames[streaming + 1])]  # (idle, its warm-up is queued on its worker)
                engine._rollover.spare.wait_until(time.perf_counter() + 60)
                spare = engine._rollover.spare.engine
                assert not spare.eager_steps and spare.runner.recorded is not None
                assert spare.runner.recorded is not eager_graphs[1] and spare.at_stream_start
                pushes += [engine.push(frame) for frame in frames[streaming + 2:]] + [engine.finish()]
            else:
                pushes = [engine.push(frame) for frame in frames] + [engine.finish()]
            stats = engine.stats()
            assert stats["lookahead"] and stats["rollovers"] == stats["rollovers_ahead"] >= 2
        finally:
            engine.close()
        finals[switched] = [p for push in pushes for p in push if not p.provisional]
    assert [(p.frame_index, p.chunk_index, p.frame_type) for p in finals[True]] == \
        [(p.frame_index, p.chunk_index, p.frame_type) for p in finals[False]]
    between = errors(finals[True], as_golden(finals[False]))
    print("switched against compiled throughout:", between)
    # Each of the two bf16 paths (eager, compiled) is within the tolerance of the float32 steps, so the two
    # are within twice it of each other (on these noise frames, depth 0.29 sigma).
    for key, limit in BF16_TOLERANCE.items():
        assert between[key] <= 2 * limit, f"{key}: {between[key]:.3f} sigma"


# A run as `stream-recon` makes it, in a process of its own (Dynamo's in-memory caches are per process):
# prints run.json's compile setting and compile_beside summary, and Inductor's graph-cache counters.
_RUN_IN_A_NEW_PROCESS = """
import json, sys
from pathlib import Path
from torch._dynamo.utils import counters
from stream_recon.app.options import RunOptions
from stream_recon.app.run.pipeline import run_sequence
frames, output, checkpoint, compile = sys.argv[1:]
options = RunOptions(checkpoint=checkpoint, device="cuda", scale_frames=3, window=4, image_width=224, viewer=False,
                     compile=compile, save_depth="float32")
summary = run_sequence(frames, output, options)
run = json.loads((Path(output) / "run.json").read_text())
print(json.dumps({"status": summary.status, "compile": run["settings"]["compile"],
                  "beside": run["summary"].get("compile_beside"), "inductor": dict(counters["inductor"]),
                  "while_streaming": run["summary"].get("compiled_while_streaming")}))
"""


def _run_in_a_new_process(frames, output, checkpoint, compile, caches) -> dict:
    import json
    import os
    import subprocess
    import sys

    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(caches), "TRITON_CACHE_DIR": str(caches / "triton")}
    result = subprocess.run([sys.executable, "-c", _RUN_IN_A_NEW_PROCESS, str(frames), str(output), str(checkpoint),
                             compile], capture_output=True, text=True, env=environment, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_new_size_streams_uncompiled_and_the_next_run_compiles_from_what_its_child_compiled(
        golden_checkpoint, golden_frame_folder, tmp_path):
    """--compile auto on empty compile caches: the run streams uncompiled (nothing compiled in its process)
    while a child compiles its size; the next run of that size compiles every graph from Inductor's
    caches (no miss), where a run compiling on empty caches misses (the counter is not vacuous)."""
    caches = tmp_path / "caches"
    first = _run_in_a_new_process(golden_frame_folder, tmp_path / "first", golden_checkpoint, "auto", caches)
    print("first run:", first)
    assert first["status"] == "complete" and first["compile"] is False
    assert first["beside"]["status"] in ("compiling", "done") and first["inductor"].get("fxgraph_cache_miss", 0) == 0
    record = caches / "stream-recon-compiled" / f"{first['beside']['key']}.compiled"
    deadline = time.monotonic() + 300
    while not record.exists() and time.monotonic() < deadline:
        time.sleep(1)
    assert record.exists(), (caches / "stream-recon-compiled" / f"{first['beside']['key']}.log").read_text()[-3000:]
    second = _run_in_a_new_process(golden_frame_folder, tmp_path / "second", golden_checkpoint, "auto", caches)
    print("second run:", second, "child:", record.read_text())
    assert second["status"] == "complete" and second["compile"] is True
    # 14 frames: too short to compile beside, it steps as written to its end and compiles nothing
    assert second["while_streaming"]["from_frame"] is None and "14 frames" in second["while_streaming"]["off"]
    assert second["inductor"].get("fxgraph_cache_miss", 0) == 0
    long = tmp_path / "long_frames"  # the golden frames over and over: a stream long enough to compile beside
    long.mkdir()
    for index in range(1000):
        (long / f"{index:06d}.png").symlink_to(golden_frame_folder / f"{index % 14:06d}.png")
    third = _run_in_a_new_process(long, tmp_path / "third", golden_checkpoint, "auto", caches)
    print("a longer run:", third)
    assert third["status"] == "complete" and third["compile"] is True and third["beside"]["status"] == "compiled by the run"
    assert third["while_streaming"]["off"] is None and third["while_streaming"]["from_frame"] is not None
    assert third["inductor"].get("fxgraph_cache_miss", 0) == 0 and third["inductor"]["fxgraph_cache_hit"] >= 10
    cold = _run_in_a_new_process(golden_frame_folder, tmp_path / "cold", golden_checkpoint, "on", tmp_path / "empty")
    print("compiled on empty caches:", cold)
    assert cold["compile"] is True and cold["inductor"]["fxgraph_cache_miss"] >= 10
    from golden_utils import compare_run_with_golden

    for run in ("first", "second"):  # uncompiled and compiled, both the official outputs
        compare_run_with_golden(tmp_path / run, "all_keyframes", BF16_TOLERANCE)


def test_a_model_prepared_without_weights_is_the_loaded_one_prepared_but_zero_on_cuda(gpu_model):
    """bf16 on CUDA: the fused GELU, the camera head's float16 weights, the range kernel for frames and the
    channels-last head, as the loaded checkpoint gets them: same modules, names, shapes, dtypes, strides."""
    from stream_recon.models import prepare_for_inference
    from stream_recon.models.builds.prepare import prepare_without_weights

    real = prepare_for_inference(gpu_model, "cuda", torch.bfloat16, compile=False)
    zero = prepare_without_weights(gpu_model.config, "cuda", torch.bfloat16)
    assert [(name, type(m)) for name, m in zero.named_modules()] == [(name, type(m)) for name, m in real.named_modules()]
    described = [{name: (v.shape, v.dtype, v.stride()) for name, v in model.state_dict().items()}
                 for model in (zero, real)]
    assert described[0] == described[1] and zero.inference_spec == real.inference_spec
    assert [getattr(m, "self_attention", None) for m in zero.modules()] == \
        [getattr(m, "self_attention", None) for m in real.modules()]


# An uncompiled run in a process of its own on empty Triton caches, listening to every Triton build:
# prints run.json's warm-up parts and, per build, its thread and whether Triton's cache held it.
_BUILDS_IN_A_NEW_PROCESS = """
import json, sys, threading
from pathlib import Path
from triton import knobs
builds = []
def listen(*, src, metadata, metadata_group, times, cache_hit):
    builds.append({"kernel": metadata.get("name"), "thread": threading.current_thread().name, "cache_hit": cache_hit})
knobs.compilation.listener = listen
from stream_recon.models.stream.chunked import ChunkedEngine
warm_up = ChunkedEngine.warm_up
def marked_warm_up(self, image, **kwargs):
    seconds = warm_up(self, image, **kwargs)
    builds.append({"kernel": None, "thread": "the warm-up ended", "cache_hit": False})
    return seconds
ChunkedEngine.warm_up = marked_warm_up
from stream_recon.app.options import RunOptions
from stream_recon.app.run.pipeline import run_sequence
frames, output, checkpoint = sys.argv[1:]
options = RunOptions(checkpoint=checkpoint, device="cuda", scale_frames=3, window=4, image_width=224, viewer=False,
                     compile="off", save_depth="float32")
summary = run_sequence(frames, output, options)
run = json.loads((Path(output) / "run.json").read_text())
print(json.dumps({"status": summary.status, "warm_up": run["summary"]["timings"]["warm_up_parts_s"], "builds": builds}))
"""


def test_a_fresh_process_builds_our_kernels_in_children_beside_its_load_and_streams_the_official_outputs(
        golden_checkpoint, golden_frame_folder, tmp_path):
    """On empty Triton caches, an uncompiled run builds its Triton kernels off the stream's thread: the
    range kernel's scheduler builds on a thread started before the checkpoint loads, and the warm-up's
    dry pass, run on a zero model while the checkpoint loads, lists the rest, which child processes build
    into Triton's cache; the pass's pool then loads them from there (cache hits). The stream's thread builds
    nothing, in the warm-up or after it, and the run directory holds the official outputs. A second run on
    the same caches starts no child, and builds nothing but cache hits."""
    import json
    import os
    import subprocess
    import sys

    from golden_utils import compare_run_with_golden

    environment = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"),
                   "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}

    def run_in_a_new_process(name: str) -> dict:
        result = subprocess.run([sys.executable, "-c", _BUILDS_IN_A_NEW_PROCESS, str(golden_frame_folder),
                                 str(tmp_path / name), str(golden_checkpoint)],
                                capture_output=True, text=True, env=environment, timeout=400)
        assert result.returncode == 0, result.stderr[-3000:]
        run = json.loads(result.stdout.strip().splitlines()[-1])
        assert run["status"] == "complete"
        compare_run_with_golden(tmp_path / name, "all_keyframes", BF16_TOLERANCE)
        return run

    def in_the_warm_up_and_after(builds: list[dict]) -> tuple[list[dict], list[dict]]:
        ended = [build["thread"] for build in builds].index("the warm-up ended")  # a mark, not a build
        return builds[:ended], builds[ended + 1:]

    run = run_in_a_new_process("run")
    in_the_warm_up, later = in_the_warm_up_and_after(run["builds"])
    built = [b for b in in_the_warm_up if not b["cache_hit"]]
    print("warm-up:", run["warm_up"], "built:", [(b["kernel"], b["thread"]) for b in built], "later:", later)
    assert not [build for build in later if build["thread"] == "MainThread"]  # the stream's thread waits for none
    loaded_on_the_pool = [b for b in in_the_warm_up if b["thread"].startswith("kernel-build_") and b["cache_hit"]]
    early = [build for build in built if build["thread"] == "kernel-build-early"]
    in_children = run["warm_up"]["kernel_builds_in_children"]
    assert 5 <= in_children <= len(loaded_on_the_pool) and in_children <= run["warm_up"]["kernel_builds"]
    assert run["warm_up"]["kernel_builds_ahead_s"] > 0  # the dry pass ran beside the load, not in the warm-up
    assert len(early) == 2 and all(b["thread"].startswith("kernel-build") for b in built), built

    again = run_in_a_new_process("again")
    assert again["warm_up"]["kernel_builds_in_children"] == 0
    assert not [b for b in sum(in_the_warm_up_and_after(again["builds"]), []) if not b["cache_hit"]]
