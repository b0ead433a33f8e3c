"""Write the loop-detection test fixture from the official repository's `example/loop` scene.

    .venv/bin/python scripts/make_loop_fixture.py SOURCE_DIR [--out tests/data/loop] [--step 3] [--scale 1.0]

SOURCE_DIR holds the scene's 237 PNG frames (000000.png ... 000236.png, 518 x 294). Every `step`-th
frame (0, 3, ..., 234 by default: 79 frames, the last ones back at the walk's start) is resized by
`scale` with area interpolation when `scale` is not 1 and written as a JPEG of quality 90 under its
original frame number, so that a fixture file name is the frame's index in the original scene.

The default keeps the original 518 x 294: the office's walls are poorly textured, and at half size
(259 x 147: a median of ~180 SIFT keypoints a frame) COLMAP registers only 33 of the 79 frames and
not the return to the start; at full size it registers 69 in one model, the loop included.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import cv2

JPEG_QUALITY = 90  # ~25 kB a frame at 518 x 294: 79 frames are 2.0 MB, under the fixture's 3 MB


def write_fixture(source: Path, out: Path, step: int, scale: float) -> list[Path]:
    frames = sorted(source.glob("*.png"))
    if not frames:
        raise SystemExit(f"no PNG frames in {source}")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in frames[::step]:
        image = cv2.imread(str(path), cv2.IMREAD_COLOR)
        if scale != 1.0:
            height, width = image.shape[:2]
            size = (round(width * scale), round(height * scale))
            image = cv2.resize(image, size, interpolation=cv2.INTER_AREA)
        target = out / f"{path.stem}.jpg"
        cv2.imwrite(str(target), image, [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
        written.append(target)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", type=Path, help="folder of the scene's PNG frames")
    parser.add_argument("--out", type=Path, default=Path("tests/data/loop"))
    parser.add_argument("--step", type=int, default=3, help="keep every step-th frame")
    parser.add_argument("--scale", type=float, default=1.0, help="resize factor")
    args = parser.parse_args()
    written = write_fixture(args.source, args.out, args.step, args.scale)
    total = sum(path.stat().st_size for path in written)
    print(f"{len(written)} frames, {total / 1e6:.2f} MB in {args.out}")


if __name__ == "__main__":
    main()
