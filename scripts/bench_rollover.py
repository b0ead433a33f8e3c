"""Frame intervals around window rollovers, with and without the next window's lookahead (GPU machine).

    python3 scripts/bench_rollover.py [--frames 420 --window-frames 120 --budgets 20 12]

The engine alone (WindowedEngine, graphs, pipelined, keyframes all) on synthetic frames, windows
shortened so that a short run has several rollovers (the cache is as full as at the defaults once
window_frames > scale + window). Prints, per variant, the intervals between consecutive new frames
from 12 frames before each window closes to 3 after the next one took over, the longest, the steady
FPS, how many frames after its end each closing window went on predicting, and the spare's stage costs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import build_model  # noqa: E402

from stream_recon.models import StreamConfig, prepare_for_inference  # noqa: E402
from stream_recon.models.windowed import WindowedEngine  # noqa: E402


def run(model, frames, args, lookahead: bool, budget_ms: float) -> dict:
    engine = WindowedEngine(model, StreamConfig(scale_frames=8, window=64), window_frames=args.window_frames,
                            overlap=args.overlap, lookahead=lookahead, lookahead_budget_ms=budget_ms)
    first_seen: dict[int, float] = {}
    try:
        for image in frames:
            for prediction in engine.push(image):
                first_seen.setdefault(prediction.frame_index, time.perf_counter())
        for prediction in engine.finish():
            first_seen.setdefault(prediction.frame_index, time.perf_counter())
        delays = engine.stats()["switch_delays"]
        costs = dict(engine._spare.stage_costs) if engine._spare is not None else {}
    finally:
        engine.close()
    order = sorted(first_seen)
    times = np.array([first_seen[i] for i in order])
    intervals = 1000 * np.diff(times)  # intervals[i]: from frame order[i] to order[i + 1]
    steady = intervals[72:]
    ends = [args.window_frames + k * (args.window_frames - args.overlap) for k in range(len(frames))]
    ends = [end for end in ends if end < len(frames)]
    delays = delays[-len(ends):] if delays else [0] * len(ends)
    around = {end: [round(float(v), 1) for v in intervals[end - 13: end + delay + 3]]
              for end, delay in zip(ends, delays, strict=False)}
    scale_ms = sum(cost for (kind, _), cost in costs.items() if kind == 7)
    return {"steady_fps": 1000 / float(np.mean(steady)), "p50_ms": float(np.median(steady)),
            "longest_ms": float(steady.max()), "around_rollovers": around, "switch_delays": delays,
            "scale_step_ms": scale_ms, "scale_stages": sum(1 for kind, _ in costs if kind == 7),
            "streaming_step_ms": costs.get((8, 0))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=420)
    parser.add_argument("--window-frames", type=int, default=120)
    parser.add_argument("--overlap", type=int, default=16)
    parser.add_argument("--budgets", type=float, nargs="*", default=[20.0, 12.0], help="lookahead ms per frame")
    args = parser.parse_args()
    loaded, _ = build_model("lingbot-map")
    model = prepare_for_inference(loaded, "cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    frames = [(255 * torch.rand(3, 378, 518, generator=generator)).to(torch.uint8) for _ in range(args.frames)]
    variants = [("in place", False, 20.0)] + [(f"lookahead, {b:g} ms a frame", True, b) for b in args.budgets]
    run(model, frames[:100], args, False, 20.0)  # compile and warm up
    for name, lookahead, budget in variants:
        result = run(model, frames, args, lookahead, budget)
        print(f"== {name}: steady {result['steady_fps']:.2f} FPS, p50 {result['p50_ms']:.1f} ms, "
              f"longest {result['longest_ms']:.1f} ms, switch delays {result['switch_delays']}", flush=True)
        for frame, values in result["around_rollovers"].items():
            print(f"   window closing at frame {frame}: intervals {values}")
        if lookahead:
            print(f"   spare's scale step {result['scale_step_ms']:.1f} ms in {result['scale_stages']} stages, "
                  f"streaming step {result['streaming_step_ms']} ms (device time, last timed)")

if __name__ == "__main__":
    main()
