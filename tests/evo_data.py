"""Real trajectories for the tests, taken from evo's source distribution on PyPI.

evo's sdist ships real trajectories in `evo-<version>/test/data/`: TUM RGB-D sequences (ground truth,
ORB-SLAM keyframes, RGB-D SLAM) for the evo-equivalence tests, and KITTI odometry sequence 00's ground
truth (4,541 poses, a car that drives past the same places several times) and EuRoC MAV V1_02's (a drone
flying about one room) for the pose graph's tests. They are not ours to commit, so the tests read them from the folder
named by STREAM_RECON_EVO_DATA (.ci/run downloads the sdist and sets it). Without that variable the files
are fetched once with `pip download` into a user cache; when neither works the tests skip and say why.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

EVO_DATA_ENV = "STREAM_RECON_EVO_DATA"
EVO_SDIST_VERSION = "1.38.1"
EVO_SDIST_SHA256 = "1d63faeeb37604641db65bdd08b0e83e71884071de368058a9c45bdcac3fc3f7"
REAL_TRAJECTORIES = (
    "freiburg1_xyz-groundtruth.txt",
    "freiburg1_xyz-ORB_kf_mono.txt",  # monocular ORB-SLAM keyframes: unknown scale, so Sim(3)
    "freiburg1_xyz-rgbdslam.txt",  # RGB-D SLAM: metric, so SE(3)
    "fr2_desk_groundtruth.txt",
    "fr2_desk_ORB.txt",
    "fr2_desk_ORB_kf_mono.txt",
    "KITTI_00_gt.txt",  # KITTI's pose format: a row-major [3, 4] camera-to-world a line
    "V102_groundtruth.csv",  # EuRoC MAV V1_02's ground truth (200 Hz CSV: time ns, position, quaternion w x y z)
)


def _cache_dir() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "stream-recon" / f"evo-{EVO_SDIST_VERSION}-test-data"


def _missing(folder: Path) -> list[str]:
    return [name for name in REAL_TRAJECTORIES if not (folder / name).is_file()]


def _download_into(folder: Path) -> str | None:
    """Fetch the sdist with pip and copy the trajectories into `folder`; the reason on failure, else None."""
    with tempfile.TemporaryDirectory() as download_dir:
        command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
        command += [f"evo=={EVO_SDIST_VERSION}", "-d", download_dir]
        try:
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as error:
            detail = (getattr(error, "stderr", None) or str(error)).strip().splitlines() or ["no output"]
            return f"`pip download evo=={EVO_SDIST_VERSION}` failed ({detail[-1]})"
        sdist = Path(download_dir) / f"evo-{EVO_SDIST_VERSION}.tar.gz"
        if not sdist.is_file() or hashlib.sha256(sdist.read_bytes()).hexdigest() != EVO_SDIST_SHA256:
            return f"the downloaded {sdist.name} is missing or not the expected file (sha256 differs)"
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as archive:
            for name in REAL_TRAJECTORIES:
                # Read the member's bytes and write them ourselves: no path from the archive is trusted.
                member = archive.extractfile(f"evo-{EVO_SDIST_VERSION}/test/data/{name}")
                partial = folder / f"{name}.partial"
                partial.write_bytes(member.read())
                partial.replace(folder / name)
    return None


def evo_data_dir() -> Path:
    """The folder holding REAL_TRAJECTORIES; fails on a wrong STREAM_RECON_EVO_DATA, skips when offline."""
    named = os.environ.get(EVO_DATA_ENV)
    if named:
        missing = _missing(Path(named))
        if missing:
            pytest.fail(f"{EVO_DATA_ENV}={named} lacks {', '.join(missing)} (expected evo's sdist test/data)")
        return Path(named)
    cache = _cache_dir()
    if _missing(cache):
        reason = _download_into(cache)
        if reason:
            pytest.skip(
                f"real trajectories unavailable: {EVO_DATA_ENV} is not set and {reason}; set it to the "
                f"test/data folder of evo-{EVO_SDIST_VERSION}.tar.gz from PyPI (.ci/run does)"
            )
    return cache
