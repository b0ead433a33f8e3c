"""A small dataset tree on disk for the batch tests: real PNGs, a real (and a broken) video, TUM files."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

TUM_START = 1305031102.175304  # a real TUM-style clock, so timestamps are not small numbers
TUM_RATE_HZ = 30.0


def textured_frame(index: int, width: int, height: int) -> np.ndarray:
    """BGR uint8 frame: a smooth pattern that drifts with the index (so consecutive frames differ a little)."""
    v, u = np.mgrid[0:height, 0:width].astype(np.float32)
    shift = 2.0 * index
    red = 127 + 100 * np.sin((u + shift) / 7.0)
    green = 127 + 100 * np.cos((v - shift) / 5.0)
    blue = 127 + 100 * np.sin((u + v + shift) / 11.0)
    return np.stack([blue, green, red], axis=-1).astype(np.uint8)


def circle_c2w(count: int) -> np.ndarray:
    """A camera on a slow arc, looking inward: c2w [count, 4, 4]."""
    poses = np.tile(np.eye(4), (count, 1, 1))
    for index in range(count):
        angle = 0.05 * index
        poses[index, :3, :3] = [
            [np.cos(angle), 0, np.sin(angle)],
            [0, 1, 0],
            [-np.sin(angle), 0, np.cos(angle)],
        ]
        poses[index, :3, 3] = [np.sin(angle), 0.02 * index, 1 - np.cos(angle)]
    return poses


def write_image_folder(folder: Path, count: int, width: int = 64, height: int = 48) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        cv2.imwrite(str(folder / f"frame_{index:04d}.png"), textured_frame(index, width, height))
    return folder


def write_video(path: Path, count: int, width: int = 64, height: int = 48, fps: float = 10.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    assert writer.isOpened(), f"OpenCV cannot write mp4v to {path}"
    for index in range(count):
        writer.write(textured_frame(index, width, height))
    writer.release()
    return path


def write_broken_video(path: Path) -> Path:
    """An .mp4 whose bytes are not a video (a cut-off download)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4)
    return path


def write_tum_sequence(folder: Path, count: int, width: int = 64, height: int = 48) -> Path:
    """TUM RGB-D layout: rgb/, depth/, rgb.txt, depth.txt, groundtruth.txt (denser than the frames)."""
    (folder / "rgb").mkdir(parents=True, exist_ok=True)
    (folder / "depth").mkdir(parents=True, exist_ok=True)
    rgb_lines, depth_lines = (
        ["# color images", "# timestamp filename"],
        ["# depth maps", "# timestamp filename"],
    )
    for index in range(count):
        stamp = TUM_START + index / TUM_RATE_HZ
        name = f"{stamp:.6f}.png"
        cv2.imwrite(str(folder / "rgb" / name), textured_frame(index, width, height))
        rgb_lines.append(f"{stamp:.6f} rgb/{name}")
        depth_stamp = stamp + 0.004
        depth_m = (
            1.0 + 0.5 * np.sin(np.arange(width)[None, :] / 9.0 + index) + 0.001 * np.arange(height)[:, None]
        )
        cv2.imwrite(
            str(folder / "depth" / f"{depth_stamp:.6f}.png"), np.round(depth_m * 5000).astype(np.uint16)
        )
        depth_lines.append(f"{depth_stamp:.6f} depth/{depth_stamp:.6f}.png")
    (folder / "rgb.txt").write_text("\n".join(rgb_lines) + "\n")
    (folder / "depth.txt").write_text("\n".join(depth_lines) + "\n")
    # Ground truth at twice the frame rate, offset by 2 ms, as a motion-capture system would record it.
    gt_count = 2 * count + 2
    gt_stamps = TUM_START - 1 / (2 * TUM_RATE_HZ) + 0.002 + np.arange(gt_count) / (2 * TUM_RATE_HZ)
    poses = circle_c2w(gt_count)
    lines = ["# ground truth trajectory", "# timestamp tx ty tz qx qy qz qw"]
    for stamp, pose in zip(gt_stamps, poses, strict=True):
        qw, qx, qy, qz = _quat_wxyz(pose[:3, :3])
        tx, ty, tz = pose[:3, 3]
        lines.append(f"{stamp:.4f} {tx:.4f} {ty:.4f} {tz:.4f} {qx:.4f} {qy:.4f} {qz:.4f} {qw:.4f}")
    (folder / "groundtruth.txt").write_text("\n".join(lines) + "\n")
    return folder


def _quat_wxyz(rotation: np.ndarray) -> np.ndarray:
    # Rotations about y only here: q = (cos(a/2), 0, sin(a/2), 0).
    angle = np.arctan2(rotation[0, 2], rotation[0, 0])
    return np.array([np.cos(angle / 2), 0.0, np.sin(angle / 2), 0.0])


def write_dataset_tree(root: Path, *, frames: int = 10) -> Path:
    """root/
    images/frames_a/*.png        image folder
    tum/rgbd_dataset_synth/      TUM RGB-D with ground truth and depth
    videos/clip.mp4              video
    videos/zz_broken.mp4         not a video
    """
    write_image_folder(root / "images" / "frames_a", frames)
    write_tum_sequence(root / "tum" / "rgbd_dataset_synth", frames)
    write_video(root / "videos" / "clip.mp4", frames)
    write_broken_video(root / "videos" / "zz_broken.mp4")
    return root
