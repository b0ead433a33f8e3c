"""What a chunk's scale step costs on the GPU (GPU machine): eager (as streams run it) against
compiled, host issue time against device time.

    python3 scripts/time_scale_step.py [--repeats 5]

The scale step (the first `scale_frames` frames together) runs once per chunk; at a rollover the
next chunk's scale step is most of what its lookahead has to fit beside the stream.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import build_model  # noqa: E402

from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference  # noqa: E402


def time_scale_steps(engine: StreamingEngine, frames: list[torch.Tensor], repeats: int) -> dict[str, float]:
    """ms per scale step: host time until the step is issued, device time (events), and the wall
    time of the push that runs it (its predictions on the host)."""
    issued, device, wall = [], [], []
    runner = engine.runner
    run = runner.run_scale_frames

    def timed(images: torch.Tensor, time_index: int):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        staged = run(images, time_index)
        end.record()
        issued.append(1000 * (time.perf_counter() - began))
        device.append((start, end))
        return staged

    runner.run_scale_frames = timed
    for _ in range(repeats):
        engine.reset()
        for frame in frames[:-1]:
            engine.push(frame)
        torch.cuda.synchronize()
        began = time.perf_counter()
        engine.push(frames[-1])
        wall.append(1000 * (time.perf_counter() - began))
    runner.run_scale_frames = run
    return {"issue_ms": statistics.median(issued), "device_ms": statistics.median(s.elapsed_time(e) for s, e in device),
            "wall_ms": statistics.median(wall)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--height", type=int, default=378)
    parser.add_argument("--width", type=int, default=518)
    args = parser.parse_args()
    loaded, _ = build_model("lingbot-map")
    model = prepare_for_inference(loaded, "cuda", torch.bfloat16)
    engine = StreamingEngine(model, StreamConfig(scale_frames=8, window=64))
    frames = [torch.randint(0, 256, (3, args.height, args.width), dtype=torch.uint8) for _ in range(8)]
    engine.push(frames[0])  # sets the engine up
    eager = time_scale_steps(engine, frames, args.repeats)
    print("eager   ", {k: round(v, 1) for k, v in eager.items()}, flush=True)
    runner = engine.runner

    def compiled_scale_step(images: torch.Tensor, time_index: int):
        runner.begin(images, 0)
        return runner.finish(time_index)

    runner.run_scale_frames = compiled_scale_step  # without the eager stance: compiled for 8 frames
    began = time.perf_counter()
    time_scale_steps(engine, frames, 1)
    print(f"compile  {time.perf_counter() - began:.1f} s", flush=True)
    compiled = time_scale_steps(engine, frames, args.repeats)
    print("compiled", {k: round(v, 1) for k, v in compiled.items()}, flush=True)


if __name__ == "__main__":
    main()
