"""The loop fixture's reference reconstruction: COLMAP (through pycolmap) on the fixture's frames.

    .venv/bin/python scripts/reference_loop_poses.py [--fixture tests/data/loop] [--threads 2] [--depth-only]

SIFT features on the CPU, exhaustive matching (every pair of the 79 frames, so the return to the
start is matched like any other pair), incremental mapping with one shared SIMPLE_RADIAL camera and a
fixed random seed. Writes beside the frames:

- `reference_poses.txt`: TUM lines `frame tx ty tz qx qy qz qw`, camera-to-world, in COLMAP's
  arbitrary frame and scale; `frame` is the image's index in the original scene.
- `reference_covisibility.json`: the camera, the registered frames, and for every pair of registered
  frames that observe at least one common triangulated point the number of such points.
- `reference_depth.npz`: for each registered frame (`"000123"`), its observations of triangulated
  points as [M, 3] float32 rows (x, y in pixels, z-depth in the poses' units): sparse depth that a
  stand-in predictor spreads into depth maps. COLMAP's frame and scale differ from run to run, so with
  `--depth-only` the poses already there stay, and the depth is scaled into their units by the
  similarity between the two runs' camera centres.

Takes about a minute on two cores. Scratch files (the database, the sparse model) go to a temporary
folder unless `--work` names one.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import pycolmap

SEED = 0  # COLMAP's RANSAC and mapper are randomised: a fixed seed makes a rerun give the same model
PEAK_THRESHOLD = 0.002
INIT_MIN_INLIERS = 50
INIT_MIN_TRI_ANGLE = 8.0
ABS_POSE_MIN_INLIERS = 20


def frame_number(image_name: str) -> int:
    """'000123.jpg' -> 123: fixture file names are the frames' indices in the original scene."""
    return int(Path(image_name).stem)


def reconstruct(fixture: Path, work: Path, threads: int) -> pycolmap.Reconstruction:
    database = work / "database.db"
    database.unlink(missing_ok=True)
    extraction = pycolmap.FeatureExtractionOptions()
    extraction.num_threads = threads
    extraction.sift.peak_threshold = PEAK_THRESHOLD
    reader = pycolmap.ImageReaderOptions()
    reader.camera_model = "SIMPLE_RADIAL"
    pycolmap.extract_features(database, fixture, camera_mode=pycolmap.CameraMode.SINGLE,
                              reader_options=reader, extraction_options=extraction, device=pycolmap.Device.cpu)
    matching = pycolmap.FeatureMatchingOptions()
    matching.num_threads = threads
    pycolmap.match_exhaustive(database, matching_options=matching, device=pycolmap.Device.cpu)
    mapping = pycolmap.IncrementalPipelineOptions()
    mapping.num_threads = threads
    mapping.random_seed = SEED
    mapping.mapper.random_seed = SEED
    mapping.triangulation.random_seed = SEED
    mapping.mapper.init_min_num_inliers = INIT_MIN_INLIERS
    mapping.mapper.init_min_tri_angle = INIT_MIN_TRI_ANGLE
    mapping.mapper.abs_pose_min_num_inliers = ABS_POSE_MIN_INLIERS
    models = pycolmap.incremental_mapping(database, fixture, work / "sparse", options=mapping)
    if not models:
        raise SystemExit("COLMAP registered no model")
    # Several models mean the walk fell apart; the largest one is reported and the count printed.
    print(f"{len(models)} model(s): sizes {[m.num_reg_images() for m in models.values()]}")
    return max(models.values(), key=lambda m: m.num_reg_images())


def tum_lines(model: pycolmap.Reconstruction) -> list[str]:
    lines = ["# frame tx ty tz qx qy qz qw (camera-to-world, COLMAP's frame and scale)"]
    for image in sorted(model.images.values(), key=lambda im: frame_number(im.name)):
        world_from_camera = image.cam_from_world().inverse()
        translation = world_from_camera.translation
        qx, qy, qz, qw = world_from_camera.rotation.quat  # Eigen's order: x, y, z, w
        values = " ".join(f"{v:.6f}" for v in (*translation, qx, qy, qz, qw))
        lines.append(f"{frame_number(image.name)} {values}")
    return lines


def shared_point_counts(model: pycolmap.Reconstruction) -> Counter:
    """(frame a, frame b) with a < b -> the number of triangulated points both observe."""
    counts: Counter = Counter()
    for point in model.points3D.values():
        frames = sorted({frame_number(model.images[el.image_id].name) for el in point.track.elements})
        counts.update(itertools.combinations(frames, 2))
    return counts


def covisibility(model: pycolmap.Reconstruction) -> dict:
    camera = next(iter(model.cameras.values()))
    counts = shared_point_counts(model)
    errors = [float(np.mean([p.error for p in model.points3D.values()]))]
    return {
        "camera": {"model": camera.model.name, "width": camera.width, "height": camera.height,
                   "params": [round(float(v), 6) for v in camera.params]},
        "registered_frames": sorted(frame_number(im.name) for im in model.images.values()),
        "num_points3d": model.num_points3D(),
        "mean_reprojection_error_px": round(errors[0], 4),
        "shared_points": [[a, b, n] for (a, b), n in sorted(counts.items())],
    }


def depth_samples(model: pycolmap.Reconstruction) -> dict[str, np.ndarray]:
    """Frame name -> [M, 3] (x, y, z-depth) of every keypoint of it that observes a triangulated point."""
    samples = {}
    for image in model.images.values():
        cam_from_world = image.cam_from_world()
        rows = []
        for point2d in image.points2D:
            if point2d.has_point3D():
                depth = (cam_from_world * model.points3D[point2d.point3D_id].xyz)[2]
                rows.append((*point2d.xy, depth))
        samples[f"{frame_number(image.name):06d}"] = np.array(rows, np.float32).reshape(-1, 3)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixture", type=Path, default=Path("tests/data/loop"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--depth-only", action="store_true",
                        help="keep reference_poses.txt and the covisibility; write depth in the poses' units")
    parser.add_argument("--work", type=Path, help="folder for COLMAP's scratch files (default: a temporary one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        model = reconstruct(args.fixture, work, args.threads)
        samples = depth_samples(model)
        poses = args.fixture / "reference_poses.txt"
        if args.depth_only:
            scale = scale_to(poses, tum_lines(model))
            samples = {name: rows * np.array([1, 1, scale], np.float32) for name, rows in samples.items()}
            print(f"depth scaled by {scale:.6f} into the units of {poses}")
        else:
            poses.write_text("\n".join(tum_lines(model)) + "\n")
            table = covisibility(model)
            (args.fixture / "reference_covisibility.json").write_text(json.dumps(table, indent=1) + "\n")
            print(f"{len(table['registered_frames'])} frames registered, {table['num_points3d']} points, "
                  f"{len(table['shared_points'])} co-visible pairs")
        np.savez_compressed(args.fixture / "reference_depth.npz", **samples)


def scale_to(poses: Path, new_lines: list[str]) -> float:
    """The scale of the similarity that maps this run's camera centres onto those of `poses` (frames in
    both), after printing how well it fits."""
    from stream_recon.models.stream.similarity import umeyama

    old = {int(row[0]): row[1:4] for row in np.loadtxt(poses, ndmin=2)}
    new = {int(line.split()[0]): np.array(line.split()[1:4], float) for line in new_lines[1:]}
    frames = sorted(old.keys() & new.keys())
    source, target = np.array([new[f] for f in frames]), np.array([old[f] for f in frames])
    fit = umeyama(source, target)
    residual = np.linalg.norm(fit.apply_to_points(source) - target, axis=1)
    extent = np.linalg.norm(target - target.mean(axis=0), axis=1).mean()
    print(f"{len(frames)} common frames; camera-centre residual {residual.mean() / extent:.2%} of the extent")
    return float(fit.scale)


if __name__ == "__main__":
    main()
