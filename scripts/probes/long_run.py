"""An unbounded-stream soak run: N frames through the chunked engine, memory and pages logged.

    python scripts/probes/long_run.py --frames 10000 --json long_run.json

Random (synthetic) weights, synthetic frames: views of a fixed smooth texture drifting by a few
pixels per frame. Every 100 frames it records the cache's pages in use, GPU memory (allocated and
reserved) and host memory (RSS); each chunk rollover is logged. Predictions are consumed and
dropped, as a sink that writes them would.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch
import torch.nn.functional as F

from stream_recon.models import GCTStream, ModelConfig, StreamConfig, prepare_for_inference
from stream_recon.models.stream.chunked import ChunkedEngine
from stream_recon.models.synthetic import load_synthetic_weights


def host_rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def texture(height: int, width: int, device: str) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(0)
    coarse = torch.rand(1, 3, height // 16, width // 16, generator=generator)
    return F.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=False).clamp(0, 1)[0].to(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=10000)
    parser.add_argument("--height", type=int, default=378)
    parser.add_argument("--width", type=int, default=518)
    parser.add_argument("--keyframes", default="flow")
    parser.add_argument("--flow-threshold", type=float, default=15.0)
    parser.add_argument("--chunk-frames", type=int, default=320)
    parser.add_argument("--overlap", type=int, default=16)
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device("meta"):
        model = GCTStream(ModelConfig())
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = prepare_for_inference(load_synthetic_weights(model.to_empty(device="cpu")).eval(), device, dtype)
    config = StreamConfig(keyframes=args.keyframes, flow_threshold=args.flow_threshold, attention=args.attention)
    engine = ChunkedEngine(model, config, chunk_frames=args.chunk_frames, overlap=args.overlap)
    big = texture(args.height * 2, args.width * 2, device)
    samples, emitted, start = [], 0, time.perf_counter()
    for i in range(args.frames):
        # A slow circular drift over the texture: consecutive frames overlap, the flow is real.
        dy = int((args.height / 2) * (1 + torch.sin(torch.tensor(i / 400.0)).item()) / 2)
        dx = int(args.width * (i % 800) / 800)
        frame = big[:, dy:dy + args.height, dx:dx + args.width]
        emitted += len(engine.push(frame, timestamp=i / 30))
        if (i + 1) % 100 == 0:
            stats = engine.stats()
            samples.append({
                "frame": i + 1,
                "seconds": time.perf_counter() - start,
                "chunk_index": stats["chunk_index"],
                "rollovers": stats["rollovers"],
                "cached_frames": stats["cached_frames"],
                "patch_pages_in_use": stats["patch_pages_in_use"],
                "special_pages_in_use": stats["special_pages_in_use"],
                "cache_bytes": stats["cache_bytes"],
                "gpu_allocated_mib": torch.cuda.memory_allocated() / 2**20 if device == "cuda" else None,
                "gpu_reserved_mib": torch.cuda.memory_reserved() / 2**20 if device == "cuda" else None,
                "host_rss_mib": host_rss_mib(),
            })
            print(json.dumps(samples[-1]), flush=True)
    emitted += len(engine.finish())
    result = {
        "frames": args.frames,
        "emitted": emitted,
        "seconds": time.perf_counter() - start,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "attention": engine.stats()["attention"],
        "chunk_frames": args.chunk_frames,
        "overlap": args.overlap,
        "keyframes": args.keyframes,
        "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None,
        "samples": samples,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
