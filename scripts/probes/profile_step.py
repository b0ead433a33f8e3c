"""Where a replayed streaming step's GPU time goes, kernel by kernel (GPU machine).

    python3 scripts/probes/profile_step.py --frames 4 --out $OUT/profile

Streams synthetic frames through the default engine (graphs, compile) until the window is full,
then records the kernels of `--frames` steps with torch.profiler. Writes:
  kernels.json   every kernel of the profiled steps in launch order: [name, start_us, duration_us]
  summary.txt    per kernel name: calls and microseconds per frame, the largest first
and prints the summary's head.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: bench.py, bench_e2e.py
from bench import build_model  # noqa: E402

from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference  # noqa: E402


def profile_stream(args) -> None:
    torch.backends.cuda.matmul.allow_tf32 = True
    loaded, _ = build_model("lingbot-map")
    model = prepare_for_inference(loaded, "cuda", torch.bfloat16, compile=not args.no_compile)
    heights = [int(h) for h in str(args.height).split(",")]
    for height in heights:
        out = Path(args.out) if len(heights) == 1 else Path(args.out) / f"{args.width}x{height}"
        print(f"== {args.width}x{height}", flush=True)
        profile_size(model, args, height, out)
        torch.cuda.empty_cache()


def profile_size(model, args, height: int, out: Path) -> None:
    # Synchronous steps: each frame's kernels in launch order, not interleaved with the next frame's.
    config = StreamConfig(scale_frames=8, window=64, attention=args.attention, pipeline=False,
                          cuda_graphs=not args.no_graphs)
    engine = StreamingEngine(model, config)
    frames = [torch.rand(3, height, args.width, device="cuda") for _ in range(4)]
    for i in range(72 + args.warmup):
        engine.push(frames[i % 4])
    torch.cuda.synchronize()
    host = host_timers(engine)
    times = []
    for i in range(args.timed):
        start = time.perf_counter()
        engine.push(frames[i % 4])
        times.append(time.perf_counter() - start)
    times.sort()
    timing = (f"{engine.stats()['attention']}: {1000 * times[len(times) // 2]:.2f} ms per frame (median of {args.timed}), "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    timing += "\nhost time per frame (us): " + ", ".join(f"{name} {1e6 * total / args.timed:.0f}" for name, total in host.items())
    host.clear()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(args.frames):
            engine.push(frames[i % 4])
        torch.cuda.synchronize()
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = sorted((e["ts"], e["name"], e["dur"]) for e in events if e.get("cat") == "kernel")
    if not kernels:
        raise SystemExit("the profiler recorded no kernels (replayed CUDA graphs hide theirs): use --no-graphs")
    t0 = kernels[0][0]
    (out / "kernels.json").write_text(json.dumps([[n, round(ts - t0, 2), d] for ts, n, d in kernels]))
    trace.unlink()
    totals, calls = defaultdict(float), defaultdict(int)
    for _, name, duration in kernels:
        totals[name] += duration / args.frames
        calls[name] += 1
    lines = [f"{len(kernels) / args.frames:.0f} kernels per frame, {sum(totals.values()) / 1000:.2f} ms of kernel time per frame"]
    for name, us in sorted(totals.items(), key=lambda item: -item[1]):
        lines.append(f"{us:9.1f} us  {calls[name] / args.frames:6.1f}x  {name[:160]}")
    (out / "summary.txt").write_text(timing + "\n" + "\n".join(lines) + "\n")
    print("\n".join(lines[:25]))
    print(timing)


def host_timers(engine) -> dict[str, float]:
    """Wall time spent in the engine's host-side steps (seconds, summed), by wrapping them."""
    totals: dict[str, float] = defaultdict(float)

    def wrap(owner, name: str, label: str):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[label] += time.perf_counter() - start
        setattr(owner, name, timed)

    recorded = getattr(engine.runner, "recorded", None)  # (None without CUDA graphs)
    wrap(engine, "push", "push")
    wrap(engine, "check_frame", "check_frame")
    wrap(engine.cache, "append", "cache.append (with moves)")
    wrap(engine.cache, "plan", "plan")
    wrap(engine.camera_cache, "begin", "camera.begin")
    if recorded is not None:
        wrap(recorded, "load_frame", "graph.load_frame")
        wrap(recorded, "replay_embed", "graph.replay_embed (launches)")
        wrap(recorded, "load_position", "graph.load_position")
        wrap(recorded, "replay_blocks", "graph.replay_blocks (launches)")
        wrap(recorded, "replay_heads", "graph.replay_heads (launches)")
    wrap(engine, "_deliver", "deliver (incl. the wait)")
    wrap(engine, "_commit", "commit")
    return totals


def time_graph(fn, inputs, repeats: int = 50) -> tuple[float, object]:
    """Capture fn(*inputs) once, replay it; milliseconds per replay and the output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn(*inputs)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats, output


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=12)
    parser.add_argument("--height", default="378", help="a height, or a comma list (one model, a folder each)")
    parser.add_argument("--width", type=int, default=518)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-graphs", action="store_true",
                        help="launch the steps' kernels one by one (torch.profiler sees no kernels inside replayed graphs)")
    parser.add_argument("--timed", type=int, default=40, help="frames timed (no profiler) before the profile")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out") + "/profile")
    args = parser.parse_args()
    profile_stream(args)


if __name__ == "__main__":
    main()
