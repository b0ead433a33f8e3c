"""How fast a source delivers model inputs, and what a frame costs its reader thread (CPU only, no model).

    python3 scripts/probes/source_rate.py [--sizes 640x480,1920x1080,3840x2160] [--frames 300] [--rounds 4] [--json out.json]

For each size, makes an mp4v video from app/sample's pictures (cut from a slightly larger copy, the cut
moving 8 pixels a frame, so that consecutive frames differ), then measures on this machine:

- one thread, frame by frame: the decode (grab, retrieve, BGR to RGB) and the crop rule
  (app.sources.preprocess.preprocess_frame_uint8 at --image-width), medians in ms;
- the source as a run opens it (app.sources.open_source with the image width: the reader thread decodes and
  resizes): frames a second delivered to a consumer that takes them as fast as they come, best of --rounds.

The reader is one thread, so the second is at most 1000 / (decode + resize ms); a consumer slower than
that (the engine) never waits for frames.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import cv2
import numpy as np

SAMPLE = Path(__file__).resolve().parents[2] / "app" / "sample"


def make_video(path: Path, width: int, height: int, frames: int) -> Path:
    pictures = [cv2.resize(cv2.imread(str(picture)), (width + 64, height + 64), interpolation=cv2.INTER_AREA)
                for picture in sorted(SAMPLE.glob("*.png"))]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 30.0, (width, height))
    for index in range(frames):
        picture = pictures[(index // 8) % len(pictures)]
        shift = index % 8 * 8
        writer.write(np.ascontiguousarray(picture[shift:shift + height, shift:shift + width]))
    writer.release()
    return path


def one_thread_ms(video: Path, image_width: int) -> tuple[float, float]:
    """Median ms of one frame's decode and of its crop rule, one after the other on this thread."""
    from stream_recon.app.sources.preprocess import preprocess_frame_uint8

    capture = cv2.VideoCapture(str(video), cv2.CAP_FFMPEG)
    decode, resize = [], []
    try:
        while True:
            started = time.perf_counter()
            ok, bgr = capture.read()
            if not ok:
                break
            rgb = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
            decoded = time.perf_counter()
            preprocess_frame_uint8(rgb, image_width)
            resize.append(time.perf_counter() - decoded)
            decode.append(decoded - started)
    finally:
        capture.release()
    return 1000 * statistics.median(decode), 1000 * statistics.median(resize)


def source_fps(video: Path, image_width: int) -> float:
    """Model inputs a second from open_source, after its first frame (the reader's start)."""
    from stream_recon.app.sources.opening import open_source

    with open_source(str(video), image_width=image_width) as source:
        frames = iter(source)
        next(frames)
        started, count = time.perf_counter(), 0
        for _ in frames:
            count += 1
        return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="640x480,1920x1080,3840x2160", help="video sizes, WxH, comma-separated")
    parser.add_argument("--frames", type=int, default=300, help="frames per video (4K: a fifth of them)")
    parser.add_argument("--rounds", type=int, default=4, help="source runs per size (the best is reported)")
    parser.add_argument("--image-width", type=int, default=518)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/stream-recon-source-rate"),
                        help="where the videos are made (kept for the next call)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    results = []
    for size in args.sizes.split(","):
        width, height = (int(side) for side in size.lower().split("x"))
        frames = args.frames if width * height < 3840 * 2160 else max(10, args.frames // 5)
        video = args.folder / f"sample_{width}x{height}_{frames}.mp4"
        if not video.exists():
            make_video(video, width, height, frames)
        decode_ms, resize_ms = one_thread_ms(video, args.image_width)
        rates = [source_fps(video, args.image_width) for _ in range(args.rounds)]
        results.append({"size": f"{width}x{height}", "decode_ms": round(decode_ms, 2),
                        "preprocess_ms": round(resize_ms, 2), "one_thread_fps": round(1000 / (decode_ms + resize_ms), 1),
                        "source_fps": round(max(rates), 1), "source_fps_rounds": [round(rate, 1) for rate in rates]})
        row = results[-1]
        print(f"{row['size']:>10}: decode {decode_ms:6.2f} ms + crop rule {resize_ms:6.2f} ms = "
              f"{row['one_thread_fps']:6.1f} FPS on one thread; the source delivers {row['source_fps']:6.1f} FPS "
              f"(rounds: {', '.join(f'{rate:.0f}' for rate in rates)})")
    if args.json:
        args.json.write_text(json.dumps({"image_width": args.image_width, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
