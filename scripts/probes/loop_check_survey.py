"""The figures behind the loop-detection thresholds: every pair of the loop fixture far enough apart to
be a loop candidate, scored by the weight-free descriptor and checked geometrically.

    .venv/bin/python scripts/probes/loop_check_survey.py [--fixture tests/data/loop] [--chunk-frames 60]

Pairs are (earlier, later) fixture frames at least `excluded_chunks` (2) chunks apart. Each is
labelled by the fixture's reference (overlapping: both registered and >= 10 common points;
unregistered: a frame COLMAP did not register; else not overlapping) and checked with RANSAC forced
to run (no minimum of matches), so that the inlier counts of hopeless pairs are measured too; then
the default thresholds are applied. Takes ~1 minute on one core.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import replace
from pathlib import Path

import cv2
import numpy as np

from stream_recon.models.loops.geometric_check import GeometricCheckConfig, check_pair, extract_features
from stream_recon.models.loops.retrieval import RetrievalConfig, gradient_grid_descriptor

MIN_SHARED_POINTS = 10  # the fixture README's overlap rule


def load(fixture: Path) -> dict[int, np.ndarray]:
    return {int(p.stem): cv2.cvtColor(cv2.imread(str(p)), cv2.COLOR_BGR2RGB) for p in sorted(fixture.glob("*.jpg"))}


def labels(reference: dict):
    registered = set(reference["registered_frames"])
    shared = {(a, b): n for a, b, n in reference["shared_points"]}

    def label(a: int, b: int) -> str:
        if a not in registered or b not in registered:
            return "unregistered"
        return "overlapping" if shared.get((a, b), 0) >= MIN_SHARED_POINTS else "not overlapping"
    return label


def summarise(name: str, rows: list[tuple], default: GeometricCheckConfig) -> None:
    print(f"\n{name}: {len(rows)} pairs")
    for label in ("overlapping", "not overlapping", "unregistered"):
        group = np.array([r[3:6] for r in rows if r[2] == label], np.float64).reshape(-1, 3)
        if not len(group):
            continue
        passed = np.sum((group[:, 1] >= default.min_inliers) & (group[:, 2] >= default.min_inlier_ratio))
        print(f"  {label:16s} n={len(group):4d}  matches median/max {np.median(group[:, 0]):.0f}/{group[:, 0].max():.0f}"
              f"  inliers median/max {np.median(group[:, 1]):.0f}/{group[:, 1].max():.0f}"
              f"  ratio of pairs with >= 10 inliers min {group[group[:, 1] >= 10, 2].min(initial=1):.2f}"
              f"  pass at defaults {passed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixture", type=Path, default=Path("tests/data/loop"))
    parser.add_argument("--chunk-frames", type=int, default=60)
    args = parser.parse_args()
    reference = json.loads((args.fixture / "reference_covisibility.json").read_text())
    label = labels(reference)
    focal, cx, cy, _ = reference["camera"]["params"]
    intrinsics = np.array([[focal, 0, cx], [0, focal, cy], [0, 0, 1]])
    images = load(args.fixture)
    descriptors = {f: gradient_grid_descriptor(im) for f, im in images.items()}
    features = {f: extract_features(im) for f, im in images.items()}
    default, retrieval = GeometricCheckConfig(), RetrievalConfig()
    forced = replace(default, min_inliers=0, min_inlier_ratio=0.0)
    pairs = [(a, b) for a, b in itertools.combinations(sorted(images), 2)
             if b // args.chunk_frames - a // args.chunk_frames >= retrieval.excluded_chunks]
    similarity = {(a, b): float(descriptors[a] @ descriptors[b]) for a, b in pairs}
    for name, k in (("fundamental (no intrinsics)", None), ("essential (reference intrinsics)", intrinsics)):
        rows = []
        for a, b in pairs:
            check = check_pair(features[b], features[a], k, k, forced)  # the later frame queries
            rows.append((a, b, label(a, b), check.matches, check.inliers, check.inlier_ratio))
        summarise(name, rows, default)
    print("\nretrieval (gradient-grid cosine):")
    for group in ("overlapping", "not overlapping", "unregistered"):
        values = np.array([s for p, s in similarity.items() if label(*p) == group])
        print(f"  {group:16s} n={len(values):4d}  min {values.min():.2f} median {np.median(values):.2f} "
              f"max {values.max():.2f}  >= {retrieval.min_similarity}: {np.mean(values >= retrieval.min_similarity):.0%}")
    for query in sorted({b for a, b in pairs if label(a, b) == "overlapping"}):
        ranked = sorted((s, a) for (a, b), s in similarity.items() if b == query)[::-1]
        best = next((rank, s, a) for rank, (s, a) in enumerate(ranked) if label(a, query) == "overlapping")
        print(f"  query {query}: best overlapping frame {best[2]} at rank {best[0] + 1} of {len(ranked)}, "
              f"cosine {best[1]:.2f}; best overall {ranked[0][1]} at {ranked[0][0]:.2f}")


if __name__ == "__main__":
    main()
