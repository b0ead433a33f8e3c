"""Frame intervals around chunk rollovers, with and without the next chunk's lookahead (GPU machine).

    python3 scripts/bench_rollover.py [--frames 420 --chunk-frames 120]
    python3 scripts/bench_rollover.py --model tiny --device cpu --height 84 --width 112 --scale 2 --window 4 \
        --frames 40 --chunk-frames 16 --overlap 4 --warmup-frames 12     # a smoke test of the script

The engine alone (ChunkedEngine, graphs, pipelined, keyframes all) on synthetic frames, chunks
shortened so that a short run has several rollovers (the cache is as full as at the defaults once
chunk_frames > scale + window). Prints, per variant, the intervals between consecutive new frames
from 12 frames before each rollover to 3 after, the longest, the steady FPS, and for the last
rollover each push from the rollover until the stream is steady again: how long it took and the
rollover's phase after it (ChunkedEngine.stats()).
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
from stream_recon.models.stream.chunked import ChunkedEngine  # noqa: E402

STEADY = "steady"  # ChunkedEngine.stats()["rollover_phase"] between rollovers


def run(model, frames, args, lookahead: bool) -> dict:
    config = StreamConfig(scale_frames=args.scale, window=args.window)
    engine = ChunkedEngine(model, config, chunk_frames=args.chunk_frames, overlap=args.overlap, lookahead=lookahead)
    first_seen: dict[int, float] = {}
    rollover_frames = []
    pushes = []  # per push: (ms it took, the rollover's phase after it)
    try:
        for image in frames:
            rollovers = engine.rollovers
            started = time.perf_counter()
            for prediction in engine.push(image):
                first_seen.setdefault(prediction.frame_index, time.perf_counter())
            pushes.append((1000 * (time.perf_counter() - started), engine.stats()["rollover_phase"]))
            if engine.rollovers != rollovers:
                rollover_frames.append(engine.num_frames - 1)
        for prediction in engine.finish():
            first_seen.setdefault(prediction.frame_index, time.perf_counter())
    finally:
        engine.close()
    order = sorted(first_seen)
    times = np.array([first_seen[i] for i in order])
    intervals = 1000 * np.diff(times)  # intervals[i]: from frame order[i] to order[i + 1]
    steady = intervals[args.scale + args.window:]
    around = {frame: [round(float(v), 1) for v in intervals[max(0, frame - 13): frame + 3]]
              for frame in rollover_frames}
    last_rollover = []  # the pushes from the last rollover until the phase is steady again
    for milliseconds, phase in pushes[rollover_frames[-1]:] if rollover_frames else []:
        last_rollover.append((round(milliseconds, 1), phase))
        if phase == STEADY:
            break
    return {"steady_fps": 1000 / float(np.mean(steady)), "p50_ms": float(np.median(steady)),
            "longest_ms": float(steady.max()), "around_rollovers": around, "last_rollover": last_rollover}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=420)
    parser.add_argument("--chunk-frames", type=int, default=120)
    parser.add_argument("--overlap", type=int, default=16)
    parser.add_argument("--scale", type=int, default=8, help="scale frames (StreamConfig.scale_frames)")
    parser.add_argument("--window", type=int, default=64, help="StreamConfig.window")
    parser.add_argument("--height", type=int, default=378)
    parser.add_argument("--width", type=int, default=518)
    parser.add_argument("--warmup-frames", type=int, default=100,
                        help="frames of the run that compiles and warms up first")
    parser.add_argument("--model", default="lingbot-map", help="model preset (tiny: a smoke test of the script)")
    parser.add_argument("--device", default="cuda",
                        help="cuda (bf16), or cpu (float32: a smoke test of the script)")
    args = parser.parse_args()
    loaded, _ = build_model(args.model)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model = prepare_for_inference(loaded, args.device, dtype)
    generator = torch.Generator().manual_seed(0)
    frames = [(255 * torch.rand(3, args.height, args.width, generator=generator)).to(torch.uint8)
              for _ in range(args.frames)]
    run(model, frames[:args.warmup_frames], args, False)  # compile and warm up
    for name, lookahead in [("in place", False), ("lookahead", True)]:
        result = run(model, frames, args, lookahead)
        print(f"== {name}: steady {result['steady_fps']:.2f} FPS, p50 {result['p50_ms']:.1f} ms, "
              f"longest {result['longest_ms']:.1f} ms", flush=True)
        for frame, values in result["around_rollovers"].items():
            print(f"   rollover at frame {frame}: intervals {values}")
        if result["last_rollover"]:
            print("   pushes from the last rollover on (ms, phase after it):", result["last_rollover"])


if __name__ == "__main__":
    main()
