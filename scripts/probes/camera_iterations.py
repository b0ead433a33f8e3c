"""`--camera-iterations 1..4`: what fewer camera-head refinements cost the poses and save in time, on the
golden inputs (tests/golden/inputs: 14 frames at 126 x 224) with the full-size model's synthetic weights.

    python3 scripts/probes/camera_iterations.py                       # CPU, float32 (minutes)
    python3 scripts/probes/camera_iterations.py --device cuda --dtype bfloat16

For each count: the engine's mean ms a frame after the first two, and its poses against all four
iterations' (max |difference| of pose_enc over its std, the golden files' measure; and the largest camera
centre and rotation difference of c2w). The speed of a real input size is scripts/bench.py's
`--camera-iterations N`; this probe is for the poses.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "tests"))
from golden_utils import golden_frames, relative_error  # noqa: E402

from stream_recon.models import GCTStream, ModelConfig, StreamConfig, StreamingEngine  # noqa: E402
from stream_recon.models.builds.prepare import prepare_for_inference  # noqa: E402
from stream_recon.models.synthetic import load_synthetic_weights  # noqa: E402


def streamed_poses(model: GCTStream, frames: torch.Tensor, iterations: int) -> tuple[np.ndarray, np.ndarray, float]:
    """pose_enc [N, 9] and c2w [N, 3, 4] of every frame streamed with `iterations` refinements, and the mean s
    a frame after the first two (the scale frames' steps differ)."""
    engine = StreamingEngine(model, StreamConfig(camera_iterations=iterations))
    predictions, seconds = [], []
    for index, frame in enumerate(frames):
        started = time.perf_counter()
        predictions += engine.push(frame, timestamp=float(index))
        if frame.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    predictions += engine.finish()
    return (np.stack([np.asarray(p.pose_enc, np.float64) for p in predictions]),
            np.stack([np.asarray(p.c2w, np.float64) for p in predictions]), float(np.mean(seconds[2:])))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GCTStream(ModelConfig())
    model = load_synthetic_weights(model.to_empty(device="cpu")).eval()
    model = prepare_for_inference(model, args.device, getattr(torch, args.dtype), compile=False)
    frames = golden_frames().to(args.device)
    runs = {count: streamed_poses(model, frames, count) for count in (4, 3, 2, 1)}
    reference, reference_c2w, _ = runs[4]
    print(f"{args.device} {args.dtype}, {len(frames)} golden frames at {tuple(frames.shape[-2:])}")
    for count, (poses, c2w, seconds) in sorted(runs.items()):
        centre = np.linalg.norm(c2w[:, :3, 3] - reference_c2w[:, :3, 3], axis=1).max()
        turned = np.einsum("nij,nik->njk", reference_c2w[:, :3, :3], c2w[:, :3, :3])
        sine = 0.5 * np.linalg.norm(turned - np.swapaxes(turned, 1, 2), axis=(1, 2)) / np.sqrt(2)
        cosine = 0.5 * (np.trace(turned, axis1=1, axis2=2) - 1)  # atan2 of both: arccos alone is coarse near 0
        angle = np.degrees(np.arctan2(sine, cosine)).max()
        print(f"--camera-iterations {count}: {1e3 * seconds:.1f} ms a frame; pose_enc max |difference| / std "
              f"{relative_error(poses, reference):.3g}; camera centres {centre:.3g} apart at most, rotations "
              f"{angle:.3g} deg")


if __name__ == "__main__":
    main()
