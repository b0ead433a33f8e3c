"""Keyframe features on the GPU for refine: kornia's SIFT in batches against OpenCV's SIFT on the CPU, in
pictures a second and in what our loop check makes of them.

Refine's loop stage is bound by OpenCV's SIFT (a 10,000-frame refine: ~2,800 of them at ~170 ms of a busy
worker, 16 workers busy 14.3 on the average) while the GPU idles. This probe answers whether kornia's SIFT
(`kornia`, `kornia_rs`: not dependencies of the product; on the GPU machine, their wheels carried) is fast
enough in batches and passes models/loops/geometric_check.py's check as OpenCV's does.

    python3 scripts/probes/gpu_sift.py --sample --count 24 --batch 8 --device cpu      # any machine, slowly
    python3 scripts/probes/gpu_sift.py --run RUN_DIR --count 512 --batch 32 --device cuda

Pictures: a run's keyframes (its npz files' pictures, in frame order) or the sample's (app/sample, at the
run's 518 x 392). Prints one JSON line: seconds a picture for OpenCV (this process, one thread) and kornia
(per batch, synchronised), and for each extractor how many neighbouring pictures (i, i + 1) pass the check.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import cv2
import numpy as np

from stream_recon.app.outputs.npz_reading import prediction_fields
from stream_recon.app.outputs.rundir import prediction_files
from stream_recon.models.loops.geometric_check import (
    FeatureConfig,
    GeometricCheckConfig,
    ImageFeatures,
    check_pair,
    extract_features,
)

SAMPLE = Path(__file__).parents[2] / "app" / "sample"
RUN_SIZE = (518, 392)  # (width, height): the model input of a 640 x 480 video


def pictures_of(run_dir: Path | None, count: int) -> tuple[list[np.ndarray], np.ndarray | None]:
    """`count` RGB pictures [H, W, 3] uint8, and the intrinsics [3, 3] of the run's first (None for the sample's)."""
    if run_dir is None:
        names = sorted(SAMPLE.glob("*.png"))[:count]
        return [cv2.resize(cv2.cvtColor(cv2.imread(str(name)), cv2.COLOR_BGR2RGB), RUN_SIZE) for name in names], None
    pictures, intrinsics = [], None
    for _, path in prediction_files(run_dir):
        fields = prediction_fields(path, "image", "is_keyframe", "intrinsics")
        if fields["is_keyframe"] and fields["image"] is not None:
            pictures.append(fields["image"])
            intrinsics = fields["intrinsics"] if intrinsics is None else intrinsics
        if len(pictures) == count:
            break
    return pictures, intrinsics


def opencv_features(pictures: list[np.ndarray], config: FeatureConfig) -> tuple[list[ImageFeatures], float]:
    cv2.setNumThreads(1)
    started = time.perf_counter()
    found = [extract_features(picture, config) for picture in pictures]
    return found, (time.perf_counter() - started) / len(pictures)


def kornia_features(pictures: list[np.ndarray], config: FeatureConfig, batch: int,
                    device: str) -> tuple[list[ImageFeatures], float]:
    """kornia's SIFT on `device`, `batch` pictures a call; descriptors as OpenCV's (x 512, saturated to uint8)."""
    import kornia.feature
    import torch

    # (kornia's SIFTFeature takes one picture a call; its scale-space variant a batch, OpenCV's descriptor layout)
    sift = kornia.feature.SIFTFeatureScaleSpace(num_features=config.max_features, upright=False, rootsift=False,
                                                device=torch.device(device), descriptor_layout="opencv")
    grey = [cv2.cvtColor(picture, cv2.COLOR_RGB2GRAY) for picture in pictures]
    found: list[ImageFeatures] = []
    with torch.inference_mode():
        sift(torch.from_numpy(grey[0]).to(device).float()[None, None] / 255)  # (its kernels built first)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        for start in range(0, len(grey), batch):
            stack = torch.from_numpy(np.stack(grey[start:start + batch])).to(device).float()[:, None] / 255
            frames, responses, descriptors = sift(stack)  # [B, N, 2, 3], [B, N], [B, N, 128]
            filled = (frames.abs().sum(dim=(2, 3)) > 0).cpu().numpy()  # (slots no detection filled are zero)
            centres = frames[:, :, :, 2].cpu().numpy().astype(np.float32)
            values = (descriptors * 512).clamp(0, 255).to(torch.uint8).cpu().numpy()
            found += [ImageFeatures(centres[n][filled[n]], values[n][filled[n]]) for n in range(len(centres))]
        seconds = time.perf_counter() - started
    return found, seconds / len(pictures)


def neighbours_passing(found: list[ImageFeatures], intrinsics: np.ndarray | None, config: GeometricCheckConfig) -> int:
    return sum(check_pair(found[n + 1], found[n], intrinsics, intrinsics, config).passed for n in range(len(found) - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", type=Path, help="a run directory kept with its pictures: its keyframes'")
    source.add_argument("--sample", action="store_true", help="the sample's pictures at 518 x 392")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    features, check = FeatureConfig(), GeometricCheckConfig()
    pictures, intrinsics = pictures_of(None if args.sample else args.run, args.count)
    if len(pictures) < 2:
        parser.error("fewer than two pictures found")
    opencv, opencv_s = opencv_features(pictures, features)
    gpu, gpu_s = kornia_features(pictures, features, args.batch, args.device)
    print(json.dumps({"pictures": len(pictures), "size": list(pictures[0].shape[:2]), "batch": args.batch,
                      "device": args.device, "opencv_s_a_picture": round(opencv_s, 4),
                      "kornia_s_a_picture": round(gpu_s, 4),
                      "features_median": {"opencv": int(np.median([len(f.keypoints) for f in opencv])),
                                          "kornia": int(np.median([len(f.keypoints) for f in gpu]))},
                      "neighbours_passing": {"opencv": neighbours_passing(opencv, intrinsics, check),
                                             "kornia": neighbours_passing(gpu, intrinsics, check),
                                             "of": len(pictures) - 1}}))


if __name__ == "__main__":
    main()
