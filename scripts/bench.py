"""Streaming throughput of the full pipeline on random (synthetic) weights.

    python scripts/bench.py --height 378 --width 518 --frames 100 --attention flashinfer
    python scripts/bench.py --breakdown          # per-stage times (CUDA events around each part)
    python scripts/bench.py --reference .reference/lingbot-map   # and the official code, same process
    python scripts/bench.py --attention auto,flashinfer --reference .reference/lingbot-map   # two backends beside it
    python scripts/bench.py --kv-cache fp8        # the fp8 K/V cache
    python scripts/bench.py --gpu-memory 8GiB     # plan for a budget, cap the process at it, print both peaks
    python scripts/bench.py --model tiny --height 84 --width 112 --scale 2 --window 4 --frames 4 --dtype fp32 \
        --no-compile                              # a smoke test of the script (on the CPU without CUDA)

Every frame's poses and depth are copied to the host, as a user's run does. The first
scale + window frames fill the cache and are timed apart; the steady state is the rest.
Prints a table and writes JSON (--json).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time
from collections import defaultdict

import torch

from stream_recon.models import GCTStream, ModelConfig, StreamConfig, StreamingEngine, prepare_for_inference
from stream_recon.models.stream.memory import estimate_memory, hold_to_card
from stream_recon.models.stream.memory_size import parse_memory_size
from stream_recon.models.synthetic import load_synthetic_weights


def build_model(preset: str) -> tuple[GCTStream, float]:
    """The model on the host with synthetic weights, as a checkpoint load leaves it."""
    start = time.perf_counter()
    with torch.device("meta"):
        model = GCTStream(ModelConfig.from_name(preset))
    model = load_synthetic_weights(model.to_empty(device="cpu")).eval()
    return model, time.perf_counter() - start


class StageTimer:
    """CUDA events around the model's parts, summed per frame step."""

    STAGES = {"dino": "aggregator.patch_embed", "frame_blocks": "aggregator.frame_blocks",
              "global_blocks": "aggregator.global_blocks", "camera_head": "camera_head", "dpt_head": "depth_head"}

    def __init__(self, model: GCTStream):
        self.events = defaultdict(list)
        for stage, path in self.STAGES.items():
            module = model.get_submodule(path)
            children = list(module) if isinstance(module, torch.nn.ModuleList) else [module]
            for child in children:
                child.register_forward_pre_hook(self._start(stage))
                child.register_forward_hook(self._stop(stage))

    def _start(self, stage):
        def hook(module, inputs):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events[stage].append([event, None])
        return hook

    def _stop(self, stage):
        def hook(module, inputs, output):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events[stage][-1][1] = event
        return hook

    def reset(self):
        self.events.clear()

    def totals_ms(self) -> dict[str, float]:
        torch.cuda.synchronize()
        return {stage: sum(a.elapsed_time(b) for a, b in pairs) for stage, pairs in self.events.items()}


def graph_parts(events, frames: int) -> dict[str, float]:
    """Per-frame ms of a replayed step's parts: the embedding graph (DINO trunk, special tokens),
    the first blocks graph (frame block 0, global block 0 up to its attention), the 24 global
    attentions, the 23 middle graphs and the last blocks graph (global block i's projection and
    MLP, frame block i+1, global block i+1 up to attention), the hand-over copy, and the heads
    graph (camera and DPT heads, output packing). With an attention recorded in the graph
    (triton, flashinfer) the first blocks graph is all the blocks. With pipelining the heads run on their
    own stream beside the next frame's blocks, so the parts overlap."""
    torch.cuda.synchronize()
    parts = {"embed": 0.0, "first_graph": 0.0, "global_attention": 0.0, "middle_graphs": 0.0, "handoff": 0.0,
             "heads": 0.0}
    named = {"embed": "embed", "attention": "global_attention", "handoff": "handoff", "heads": "heads"}
    first_of_step = True
    for part, start, end in events:
        if part == "embed":
            first_of_step = True
        key = named.get(part)
        if key is None:
            key, first_of_step = ("first_graph" if first_of_step else "middle_graphs"), False
        parts[key] += start.elapsed_time(end) / frames
    return parts


def attention_flops(engine: StreamingEngine) -> float:
    """FLOPs of one frame's global attention at the final key count: 2 matmuls x 2 FLOP per MAC."""
    c = engine.model.config
    height, width = engine.image_size
    rows, cols = c.grid(height, width)
    queries = rows * cols + c.num_special_tokens
    return 4.0 * queries * engine.cache.num_visible_tokens * c.embed_dim * c.depth


def run(args) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = True
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gc.collect()  # (an earlier run's engine and model in this process)
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    loaded, build_s = build_model(args.model)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    start = time.perf_counter()
    model = prepare_for_inference(loaded, device, dtype, compile=not args.no_compile,
                                  half_camera_weights=not args.fp32_camera_weights)
    build_s += time.perf_counter() - start
    del loaded
    budget = parse_memory_size(args.gpu_memory) if args.gpu_memory else None
    config = StreamConfig(scale_frames=args.scale, window=args.window, keyframes=args.keyframes, attention=args.attention,
                          cuda_graphs=not args.no_graphs and not args.breakdown, pipeline=not args.no_pipeline,
                          kv_cache=args.kv_cache, gpu_memory=budget, camera_iterations=args.camera_iterations)
    if budget is not None and device == "cuda":
        hold_to_card(budget)
    engine = StreamingEngine(model, config)
    engine.on_memory_plan = lambda plan: print(plan.describe(), flush=True)
    timer = StageTimer(model) if args.breakdown and device == "cuda" else None
    frames = [torch.rand(3, args.height, args.width, device=device) for _ in range(4)]
    fill = args.scale + args.window
    viewer = None
    if args.viewer:
        from stream_recon.app.viewer import LiveViewer

        viewer = LiveViewer(host="127.0.0.1", port=8765)
    viewer_on: list[bool] = []
    times = []
    cold_start = time.perf_counter()
    timing_events = []
    for i in range(fill + args.frames):
        if i == fill and timer is not None:
            timer.reset()
        recorded = getattr(engine.runner, "recorded", None)
        if i == fill and recorded is not None:  # time the graph segments and the attention calls between
            recorded.timing_events = timing_events
        if device == "cuda" and i <= fill:  # the steady state is not synchronised from outside: a
            torch.cuda.synchronize()  # pipelined push returns before its frame's work is done
        if i == fill:
            steady_start = time.perf_counter()
        start = time.perf_counter()
        predictions = engine.push(frames[i % len(frames)])  # predictions arrive on the host (numpy)
        # With --viewer, steady-state frames alternate in blocks of 10 between feeding the live
        # viewer and not, so both medians come from the same minutes of this (noisy) machine.
        feed = viewer is not None and (i < fill or ((i - fill) // 10) % 2 == 1)
        if feed:
            stats = engine.stats()
            for prediction in predictions:
                viewer.on_frame(prediction, stats)
        times.append(time.perf_counter() - start)
        viewer_on.append(feed)
        if i == args.scale:
            cold_start = time.perf_counter() - cold_start
    engine.finish()  # pipelined streaming hands the last frame over here
    if device == "cuda":
        torch.cuda.synchronize()
    # Wall time from the first steady-state push until every steady-state frame was delivered:
    # the throughput whether or not pushes return before their own frame is done.
    wall_per_frame = (time.perf_counter() - steady_start) / args.frames
    steady = sorted(times[fill:])
    median = steady[len(steady) // 2]
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "size": f"{args.width}x{args.height}",
        "dtype": args.dtype,
        "attention": engine.stats()["attention"],
        "scale_frames": args.scale,
        "window": args.window,
        "steady_frames": args.frames,
        "ms_per_frame_median": 1000 * median,
        "ms_per_frame_mean": 1000 * sum(steady) / len(steady),
        "ms_per_frame_wall": 1000 * wall_per_frame,
        "fps": 1.0 / median,
        "first_steps_s": cold_start,
        "cold_start_s": build_s + cold_start,  # model build, phase 1 and the first streaming frame (compile, capture)
        "model_build_s": build_s,
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if device == "cuda" else None,
        "cache_bytes": engine.stats()["cache_bytes"],
        "kv_cache": engine.stats()["kv_cache"],
        # what models/stream/memory.py expects for the settings that ran (the constants' check)
        "estimate_gib": estimate_memory(model, engine.config, (args.height, args.width)).to_dict(),
    }
    result["estimate_gib"] = {part: value / 2**30 for part, value in result["estimate_gib"].items()}
    if engine.memory_plan is not None:
        result["memory_plan"] = engine.memory_plan.to_dict()
    if viewer is not None:
        with_viewer = sorted(t for t, on in zip(times[fill:], viewer_on[fill:], strict=True) if on)
        without = sorted(t for t, on in zip(times[fill:], viewer_on[fill:], strict=True) if not on)
        result["ms_per_frame_median_with_viewer"] = 1000 * with_viewer[len(with_viewer) // 2]
        result["ms_per_frame_median_without_viewer"] = 1000 * without[len(without) // 2]
        result["viewer_slowdown"] = with_viewer[len(with_viewer) // 2] / without[len(without) // 2] - 1
        result["viewer_busy_seconds"] = viewer.scene_summary()["busy_seconds"]
        viewer.close("complete")
    result["cuda_graphs"] = engine.stats()["cuda_graphs"]
    if timing_events:
        parts = graph_parts(timing_events, args.frames)
        result["graph_parts_ms_per_frame"] = parts
        if parts["global_attention"]:  # (inside the graph otherwise: see scripts/probes/profile_step.py)
            result["global_attention_tflops"] = attention_flops(engine) / parts["global_attention"] / 1e9
    if timer is not None:
        result["stage_ms_per_frame"] = {k: v / args.frames for k, v in timer.totals_ms().items()}
    return result


def run_reference(args) -> dict:
    """The official implementation from a checkout of Robbyant/lingbot-map, with the settings of its
    own profiler (gct_profile.py): random weights, bf16 autocast, FlashInfer, torch.compile
    reduce-overhead on the fixed-shape blocks, its warm-up passes, a sync after every frame.

    Its timing covers model.forward only (outputs stay on the GPU), ours includes the host copy.
    """
    sys.path.insert(0, str(args.reference))
    import gct_profile  # the reference's own builder, compile choices and timing loop

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    total = args.scale + args.window + args.frames
    dtype = torch.bfloat16
    start = time.perf_counter()
    model = gct_profile.load_model("flashinfer", img_size=518, sliding_window=args.window, max_frame_num=total + 100,
                                   camera_num_iterations=4, device="cuda")
    if args.reference_fa3:
        model.aggregator.kv_cache_fa3 = True
    images = torch.randn(1, total, 3, args.height, args.width, device="cuda")
    autocast = torch.autocast("cuda", dtype=dtype)

    def rehearse(passes: int) -> None:  # gct_profile.main's warm-up: scale frames + 10 streaming frames
        for _ in range(passes):
            model.clean_kv_cache()
            torch.compiler.cudagraph_mark_step_begin()
            with torch.no_grad(), autocast:
                model.forward(images[:, :8].to(dtype), num_frame_for_scale=8, num_frame_per_block=8, causal_inference=True)
            for i in range(10):
                torch.compiler.cudagraph_mark_step_begin()
                with torch.no_grad(), autocast:
                    model.forward(images[:, 8 + i : 9 + i].to(dtype), num_frame_for_scale=8, num_frame_per_block=1,
                                  causal_inference=True)
        torch.cuda.synchronize()

    rehearse(1)
    gct_profile.compile_model(model)
    rehearse(3)
    cold_start = time.perf_counter() - start
    with contextlib.redirect_stdout(sys.stderr):
        per_frame_ms, scale, phase1_ms = gct_profile.profile_streaming(model, images, total, dtype)
    steady = sorted(per_frame_ms[args.window :])
    result = {
        "ms_per_frame_median": steady[len(steady) // 2],
        "ms_per_frame_mean": sum(steady) / len(steady),
        "fps": 1000.0 / steady[len(steady) // 2],
        "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30,
        "cold_start_s": cold_start,
        "attention": "flashinfer-fa3" if args.reference_fa3 else "flashinfer-fa2",
    }
    model = None  # free the reference before anything else runs
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="lingbot-map", help="model preset (tiny: a smoke test of the script)")
    parser.add_argument("--height", type=int, default=378)
    parser.add_argument("--width", type=int, default=518)
    parser.add_argument("--frames", type=int, default=50, help="steady-state frames timed after the window is full")
    parser.add_argument("--scale", type=int, default=8)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--keyframes", default="all")
    parser.add_argument("--attention", default="auto",
                        help="a backend, or several separated by commas: each measured in turn in this process")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--breakdown", action="store_true", help="per-stage times (runs eagerly: hooks do not fire in graphs)")
    parser.add_argument("--camera-iterations", type=int, default=None,
                        help="StreamConfig.camera_iterations: the camera head's refinement iterations (default: all)")
    parser.add_argument("--no-graphs", action="store_true", help="eager streaming steps (no CUDA-graph replay)")
    parser.add_argument("--no-compile", action="store_true", help="eager transformer blocks (no torch.compile)")
    parser.add_argument("--no-pipeline", action="store_true",
                        help="StreamConfig(pipeline=False): each frame's heads before the next frame's blocks")
    parser.add_argument("--fp32-camera-weights", action="store_true",
                        help="prepare_for_inference(half_camera_weights=False): the camera head reads float32 weights")
    parser.add_argument("--viewer", action="store_true",
                        help="feed a live viewer (no browser) in alternating blocks of 10 frames and compare")
    parser.add_argument("--kv-cache", default="auto", choices=["auto", "fp8"],
                        help="K/V cache precision (StreamConfig.kv_cache): auto = the model's, fp8 = e4m3 with scales")
    parser.add_argument("--gpu-memory", help="a budget such as 8GiB: StreamConfig.gpu_memory plans the cache for it, "
                        "and the process's allocator is capped at it less the CUDA context "
                        "(torch.cuda.set_per_process_memory_fraction)")
    parser.add_argument("--reference", help="checkout of Robbyant/lingbot-map: time it too, in this process")
    parser.add_argument("--reference-fa3", action="store_true", help="the reference with its --fa3 kernels")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    if args.viewer and args.frames < 20:  # (one block of 10 frames with the viewer, one without, at least)
        parser.error(f"--viewer compares blocks of 10 frames with and without the viewer: --frames must be at least "
                     f"20, got {args.frames}")
    attentions = args.attention.split(",")
    result = run(argparse.Namespace(**{**vars(args), "attention": attentions[0]}))
    # more backends in the same process, each on the same model and frames (their figures under "others")
    others = [run(argparse.Namespace(**{**vars(args), "attention": name})) for name in attentions[1:]]
    if others:
        result["others"] = others
    if args.reference:  # ours first, in case the reference does not get to the end
        for ours in [result, *others]:
            print(json.dumps({k: v for k, v in ours.items() if k.startswith(("attention", "ms_per", "fps", "peak", "cold"))}),
                  flush=True)
        result["reference"] = theirs = run_reference(args)
        print(f"{'':>22}  {'reference':>10}" + "".join(f"  {ours['attention']:>14}" for ours in [result, *others]))
        for key in ("ms_per_frame_median", "fps", "peak_gpu_gib"):
            print(f"{key:>22}  {theirs[key]:10.2f}" + "".join(f"  {ours[key]:14.2f}" for ours in [result, *others]))
        for ours in [result, *others]:
            ours["speedup_vs_reference"] = theirs["ms_per_frame_median"] / ours["ms_per_frame_median"]
            print(f"{ours['attention']:>22}: {ours['speedup_vs_reference']:.2f}x the reference", flush=True)
    for key, value in result.items():
        print(f"{key:>22}: {value:.3f}" if isinstance(value, float) else f"{key:>22}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
