"""Engine time per frame across input sizes, in one measuring process (GPU machine).

    python3 scripts/bench_shapes.py --heights 280:518:14 --compile-workers 4 --json $OUT/shapes.json
    python3 scripts/bench_shapes.py --heights 378,392 --variants balanced,frames --profile 378,392

Each size is measured as scripts/bench.py measures it (scale 8, window 64, bf16, keyframes all,
pipelined, CUDA graphs, compiled blocks and heads, every output copied to the host): the median
time of a push over the steady-state frames after the window is full, one engine per size and
variant on one model, so that neighbouring sizes compare on the same minutes of one machine.

Variants, measured back to back per size: `balanced` (the balanced schedule, SDPA for the frame
attention) and `frames` (the balanced schedule, and the frame attention through the range kernel:
the defaults). The others take the defaults and change
one thing: `index_copy` writes each layer's K and V with two index_copy_ calls (the write before the
store's Triton write kernel), `heads_low` runs the steps on a high-priority stream and the heads
beside them on a low-priority one (the defaults give the heads the steps' priority), `synchronous`
runs every frame's heads after its blocks on one stream (StreamConfig.pipeline off), `whole_wave`
keeps a single wave's tiles whole where the defaults cut them into prefixes and pieces,
`prefix_all` cuts every single wave that leaves a slot idle (256 tiles on 132 SMs too) as the defaults
cut 224 and 240, `prefix_two` does so with one piece after a prefix of 850/1000, and `prefix_224` cuts
only waves of at most 7/8 of the slots (224 tiles on 132 SMs: the rule before 240 tiles were cut);
`triton_kernel` runs the global attention through the Triton range kernel where the defaults run
gluon_attention's on Hopper, `pdl` compiles the blocks and heads with Inductor's programmatic dependent launch (in the measuring
process, whose compile helpers compiled the defaults only). `flashinfer` streams with --attention
flashinfer (fa3 on Hopper), `flashinfer_fa2` with FlashInfer's fa2 kernels (what it runs before Hopper)
on any GPU, and `pointers` the defaults with the range kernel (the global and the frame attention)
loading keys and values through pointers, as it does before Hopper, on any GPU.

torch.compile compiles the blocks and heads once per input size (~40 s a size on a fresh
machine). --compile-workers N starts N helper processes that stream a few frames at each size
first, so that the measuring process finds Inductor's on-disk caches warm and measures on a quiet
machine; it builds its own model meanwhile. --profile: per-kernel GPU time of a few steps at these
heights (torch.profiler), per variant, to find which kernels change from one size to the next.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch._inductor.config
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import build_model  # noqa: E402

from stream_recon.cache import backends, triton_attention, triton_store  # noqa: E402
from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference  # noqa: E402
from stream_recon.models.network.layers import Attention  # noqa: E402
from stream_recon.models.stream.steps import PipelinedRunner  # noqa: E402

SCALE, WINDOW = 8, 64
ATTEND_RANGE = triton_attention.attend_range
TENSOR_MEMORY_CAPABILITY = triton_attention.TENSOR_MEMORY_CAPABILITY
STORE_WRITE = triton_store.write
PREFIX = triton_attention.PREFIX_FILL, triton_attention.PREFIX_SHARE, triton_attention.PREFIX_PIECES
# (fill, share, pieces) of the variants that change the prefix cut
PREFIX_VARIANTS = {"whole_wave": (0.0, PREFIX[1], PREFIX[2]), "prefix_all": (1.0, PREFIX[1], PREFIX[2]),
                   "prefix_two": (1.0, 850, 2), "prefix_224": (0.875, PREFIX[1], PREFIX[2])}
# variant -> the --attention it streams with (the others: auto)
BACKEND_VARIANTS = {"flashinfer": "flashinfer", "flashinfer_fa2": "flashinfer"}
FLASHINFER = backends.spec("flashinfer")


def flashinfer_fa2(storage, layout, compile, device):
    from stream_recon.cache.backends.flashinfer import FlashInferPagedAttention

    return FlashInferPagedAttention(storage, layout.tokens_per_frame, "fa2")


def use_variant(model, variant: str) -> None:
    """Point the global attention's kernel and schedule, the blocks' frame attention and the
    store's write at `variant`'s (the next engine built records them)."""
    if variant == "triton_kernel":  # the Triton range kernel where the Gluon one would serve
        triton_attention.attend_range = functools.partial(ATTEND_RANGE, tma=True)
    else:
        triton_attention.attend_range = ATTEND_RANGE
    (triton_attention.PREFIX_FILL, triton_attention.PREFIX_SHARE,
     triton_attention.PREFIX_PIECES) = PREFIX_VARIANTS.get(variant, PREFIX)
    triton_attention.schedule_tiles.cache_clear()
    triton_attention.TENSOR_MEMORY_CAPABILITY = 99 if variant == "pointers" else TENSOR_MEMORY_CAPABILITY
    triton_store.write = index_copy_write if variant == "index_copy" else STORE_WRITE
    sdpa_frames = variant == "balanced"  # every other variant keeps the defaults' frame attention
    frame_attention = F.scaled_dot_product_attention if sdpa_frames else triton_attention.attend_frame
    for module in model.modules():
        if isinstance(module, Attention):
            module.self_attention = frame_attention
    use_launch_order(variant == "pdl")
    backends._BY_NAME["flashinfer"] = (dataclasses.replace(FLASHINFER, factory=flashinfer_fa2)
                                       if variant == "flashinfer_fa2" else FLASHINFER)


def use_launch_order(programmatic: bool) -> None:
    """`pdl`: Inductor's kernels launched with programmatic dependent launch (each may start before
    the kernel it follows ends, waiting in-kernel for its inputs); the compiled calls compile again
    (Dynamo's caches reset) whenever this changes."""
    triton_config = torch._inductor.config.triton
    if not hasattr(triton_config, "enable_pdl"):
        if not programmatic:
            return
        raise SystemExit(f"the pdl variant needs torch._inductor.config.triton.enable_pdl (torch {torch.__version__})")
    if triton_config.enable_pdl != programmatic:
        triton_config.enable_pdl = programmatic
        torch._dynamo.reset()


def parse_heights(text: str) -> list[int]:
    if ":" in text:
        first, last, step = map(int, text.split(":"))
        return list(range(first, last + 1, step))
    return [int(h) for h in text.split(",") if h]


def prepared_model():
    torch.backends.cuda.matmul.allow_tf32 = True
    loaded, _ = build_model("lingbot-map")
    return prepare_for_inference(loaded, "cuda", torch.bfloat16, compile=True)


def new_engine(model, variant: str = "frames") -> StreamingEngine:
    config = StreamConfig(scale_frames=SCALE, window=WINDOW, keyframes="all", pipeline=variant != "synchronous",
                          attention=BACKEND_VARIANTS.get(variant, "auto"))
    return StreamingEngine(model, config)


def index_copy_write(store, slots, k, v) -> None:
    """A layer's K/V write as the store wrote it before its Triton kernel: two scattered copies."""
    store[0].index_copy_(0, slots, k.to(store.dtype))
    store[1].index_copy_(0, slots, v.to(store.dtype))


@contextlib.contextmanager
def streams_for(variant: str):
    """`heads_low`: the steps on a high-priority stream, every frame's heads on a low-priority one."""
    if variant != "heads_low":
        yield
        return
    low = torch.cuda.Stream(priority=0)
    original = PipelinedRunner._heads_stream
    PipelinedRunner._heads_stream = lambda runner: low
    try:
        with torch.cuda.stream(torch.cuda.Stream(priority=-1)):
            yield
        torch.cuda.synchronize()
    finally:
        PipelinedRunner._heads_stream = original


def release(engine) -> None:
    engine.finish()
    del engine
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def compile_sizes(model, heights: list[int], width: int) -> None:
    """Stream to the first recorded streaming step at each size (compiles every streaming shape)."""
    for height in heights:
        start = time.perf_counter()
        engine = new_engine(model)
        frames = [torch.rand(3, height, width, device="cuda") for _ in range(2)]
        for i in range(SCALE + 3):
            engine.push(frames[i % 2])
        release(engine)
        print(f"compiled 518x{height} in {time.perf_counter() - start:.1f} s", flush=True)


def measure(model, height: int, width: int, steady: int, profile: bool, variant: str = "frames") -> dict:
    """bench.py's measurement: fill the window (synchronised), then the median push time; with
    `profile`, the kernels of a few more steps."""
    with streams_for(variant):
        return _measure(model, height, width, steady, profile, variant)


def _measure(model, height: int, width: int, steady: int, profile: bool, variant: str) -> dict:
    start = time.perf_counter()
    engine = new_engine(model, variant)
    frames = [torch.rand(3, height, width, device="cuda") for _ in range(4)]
    fill = SCALE + WINDOW
    times = []
    for i in range(fill + steady):
        if i <= fill:
            torch.cuda.synchronize()
        if i == fill:
            steady_start = time.perf_counter()
        begin = time.perf_counter()
        engine.push(frames[i % len(frames)])
        times.append(time.perf_counter() - begin)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - steady_start) / steady
    ordered = sorted(times[fill:])
    result = {"ms_per_frame_median": 1000 * ordered[len(ordered) // 2], "ms_per_frame_wall": 1000 * wall,
              "ms_per_frame_mean": 1000 * sum(ordered) / len(ordered), "keys": engine.cache.num_visible_tokens,
              "attention": engine.stats()["attention"]}
    if profile:
        result["kernels_us"] = profile_kernels(engine, frames)
    release(engine)
    result["seconds"] = time.perf_counter() - start
    return result


def profile_kernels(engine, frames, steps: int = 6) -> dict[str, float]:
    """Microseconds per frame of each kernel name over `steps` pipelined steps."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for i in range(steps):
            engine.push(frames[i % len(frames)])
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    totals = defaultdict(float)
    for event in events:
        if event.get("cat") == "kernel":
            totals[event["name"]] += event["dur"] / steps
    if not totals:  # (torch 2.11 traces no kernel of the defaults' replayed steps)
        print("profile: no kernel events; steps replayed as CUDA graphs may not be traced here", flush=True)
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heights", default="280:518:14", help="first:last:step, or a comma list")
    parser.add_argument("--width", type=int, default=518)
    parser.add_argument("--frames", type=int, default=40, help="steady-state frames timed per size and variant")
    parser.add_argument("--variants", default="balanced,frames")
    parser.add_argument("--profile", default="", help="heights whose kernels are profiled too (comma list)")
    parser.add_argument("--compile-workers", type=int, default=0)
    parser.add_argument("--compile-only", action="store_true", help="(a helper process: compile these sizes, exit)")
    parser.add_argument("--share", default="0/1", help="with --compile-only: i/n, every n-th size from the i-th")
    parser.add_argument("--more", default="", help="VARIANT@HEIGHTS: measure this variant too at these heights "
                        "(e.g. balanced@378,392)")
    parser.add_argument("--deadline-s", type=float, default=1e9, help="measure no new size after this many seconds")
    parser.add_argument("--wait-for", help="build the model, then wait for this file to exist before measuring "
                        "(the device script creates it once the GPU is free); the deadline counts from then")
    parser.add_argument("--json")
    args = parser.parse_args()
    began = time.perf_counter()
    heights = parse_heights(args.heights)
    if args.compile_only:
        index, count = map(int, args.share.split("/"))
        compile_sizes(prepared_model(), heights[index::count], args.width)
        return
    helpers = []
    for index in range(args.compile_workers):
        share = heights[index :: args.compile_workers]
        if share:
            command = [sys.executable, __file__, "--compile-only", "--width", str(args.width),
                       "--heights", ",".join(map(str, share))]
            helpers.append(subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "4"}))
    model = prepared_model()
    for helper in helpers:
        helper.wait()
    if args.wait_for:
        while not os.path.exists(args.wait_for):
            time.sleep(1)
        began = time.perf_counter()
    print(f"model ready, sizes compiled: {time.perf_counter() - began:.0f} s", flush=True)
    profiled = set(parse_heights(args.profile)) if args.profile else set()
    variants = args.variants.split(",")
    more = [(spec.split("@")[0], set(parse_heights(spec.split("@")[1]))) for spec in args.more.split() if spec]
    results = []
    for height in heights:
        if time.perf_counter() - began > args.deadline_s:
            print(f"deadline: 518x{height} and after not measured", flush=True)
            break
        row = {"height": height, "width": args.width}
        for variant in variants + [v for v, at in more if height in at]:
            use_variant(model, variant)
            result = measure(model, height, args.width, args.frames, profile=height in profiled, variant=variant)
            row[variant] = result
            print(f"518x{height} {variant}: {result['ms_per_frame_median']:.2f} ms/frame (wall {result['ms_per_frame_wall']:.2f}, "
                  f"{result['keys']} keys, {result['seconds']:.0f} s)", flush=True)
        use_variant(model, "frames")
        results.append(row)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}, f,
                          indent=1)
    print("height  tokens  " + "  ".join(f"{v:>9}" for v in variants) + "  step(last)")
    previous = None
    for row in sorted(results, key=lambda r: r["height"]):  # (measured in the order given)
        tokens = (row["height"] // 14) * (args.width // 14) + 6
        values = [row[v]["ms_per_frame_median"] for v in variants]
        step = f"{100 * (values[-1] / previous - 1):+.1f}%" if previous else ""
        print(f"{row['height']:6d}  {tokens:6d}  " + "  ".join(f"{x:9.2f}" for x in values) + f"  {step}")
        previous = values[-1]


if __name__ == "__main__":
    main()
