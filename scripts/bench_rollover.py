"""Frame intervals around chunk rollovers, with and without the next chunk's lookahead (GPU machine).

    python3 scripts/bench_rollover.py [--frames 420 --chunk-frames 120]

The engine alone (ChunkedEngine, graphs, pipelined, keyframes all) on synthetic frames, chunks
shortened so that a short run has several rollovers (the cache is as full as at the defaults once
chunk_frames > scale + window). Prints, per variant, the intervals between consecutive new frames
from 12 frames before each rollover to 3 after, the longest, the steady FPS, and the spare's jobs.
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
from stream_recon.models.chunked import ChunkedEngine  # noqa: E402
from stream_recon.models.lookahead import SpareEngine  # noqa: E402


def run(model, frames, args, lookahead: bool, priority: int) -> dict:
    engine = ChunkedEngine(model, StreamConfig(scale_frames=8, window=64), chunk_frames=args.chunk_frames,
                            overlap=args.overlap, lookahead=lookahead)
    spare_init = SpareEngine.__init__
    SpareEngine.__init__ = lambda self, e, priority_=priority: spare_init(self, e, priority=priority_)
    first_seen: dict[int, float] = {}
    rollover_frames = []
    jobs = []
    try:
        for image in frames:
            rollovers = engine.rollovers
            for prediction in engine.push(image):
                first_seen.setdefault(prediction.frame_index, time.perf_counter())
            if engine.rollovers != rollovers:
                rollover_frames.append(engine.num_frames - 1)
                if engine._rollover is not None:
                    jobs.append(list(engine._rollover.spare.job_times))
        for prediction in engine.finish():
            first_seen.setdefault(prediction.frame_index, time.perf_counter())
    finally:
        SpareEngine.__init__ = spare_init
        engine.close()
    order = sorted(first_seen)
    times = np.array([first_seen[i] for i in order])
    intervals = 1000 * np.diff(times)  # intervals[i]: from frame order[i] to order[i + 1]
    steady = intervals[72:]
    around = {frame: [round(float(v), 1) for v in intervals[frame - 13: frame + 3]] for frame in rollover_frames}
    return {"steady_fps": 1000 / float(np.mean(steady)), "p50_ms": float(np.median(steady)),
            "longest_ms": float(steady.max()), "around_rollovers": around, "jobs": jobs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=420)
    parser.add_argument("--chunk-frames", type=int, default=120)
    parser.add_argument("--overlap", type=int, default=16)
    args = parser.parse_args()
    loaded, _ = build_model("lingbot-map")
    model = prepare_for_inference(loaded, "cuda", torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    frames = [(255 * torch.rand(3, 378, 518, generator=generator)).to(torch.uint8) for _ in range(args.frames)]
    _, high = torch.cuda.Stream.priority_range()
    variants = [("in place", False, 0), ("lookahead", True, 0), ("lookahead, urgent spare", True, high)]
    run(model, frames[:100], args, False, 0)  # compile and warm up
    for name, lookahead, priority in variants:
        result = run(model, frames, args, lookahead, priority)
        print(f"== {name}: steady {result['steady_fps']:.2f} FPS, p50 {result['p50_ms']:.1f} ms, "
              f"longest {result['longest_ms']:.1f} ms", flush=True)
        for frame, values in result["around_rollovers"].items():
            print(f"   rollover at frame {frame}: intervals {values}")
        for jobs in result["jobs"][-1:]:
            start = jobs[0][1]
            print("   spare jobs (ms from the first):",
                  [(name_, round(1000 * (a - start)), round(1000 * (b - a))) for name_, a, b in jobs[-10:]])


if __name__ == "__main__":
    main()
