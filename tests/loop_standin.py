"""A stand-in for the chunked engine on the `loop` fixture: the reference poses, drifted chunk by chunk.

No model runs. Each chunk sees the scene exactly (the COLMAP reference poses, and depth spread from the
reference's triangulated points), but each rollover's alignment is off by a random Sim(3) of known
size, so the emitted open chain drifts as a real one does, and the walk's return to its start is a loop
whose correction the tests can check against the reference.

Emission order as ChunkedEngine's in place: every frame when first predicted; at a rollover the next
chunk's shared frames again (final), then the new frame.
"""

from __future__ import annotations

import json
import time
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.spatial import cKDTree

from stream_recon.models.stream.chunks import ChunkLink
from stream_recon.models.stream.pose import quat_xyzw_to_rotation, rotation_to_quat_xyzw
from stream_recon.models.stream.prediction import FRAME_KEY, FRAME_SCALE, FramePrediction
from stream_recon.models.stream.similarity import Sim3

LOOP_FIXTURE = Path(__file__).parent / "data" / "loop"
SURE_CONFIDENCE, UNSURE_CONFIDENCE = 5.0, 1.0
SURE_RADIUS_PX = 2.0  # depth counts as known within this distance of a reference observation


@dataclass(frozen=True)
class LoopScene:
    frames: tuple[int, ...]  # the registered fixture frames, in stream order (their numbers in the scene)
    c2w: np.ndarray  # [N, 3, 4] the reference's camera-to-world
    intrinsics: np.ndarray  # [3, 3]
    samples: dict[int, np.ndarray]  # frame -> [M, 3] (x, y, z-depth)
    height: int
    width: int

    def image_path(self, frame: int) -> Path:
        return LOOP_FIXTURE / f"{frame:06d}.jpg"


def load_loop_scene() -> LoopScene:
    rows = np.loadtxt(LOOP_FIXTURE / "reference_poses.txt", ndmin=2)
    camera = json.loads((LOOP_FIXTURE / "reference_covisibility.json").read_text())["camera"]
    focal, cx, cy = camera["params"][:3]
    c2w = np.concatenate([quat_xyzw_to_rotation(rows[:, 4:8]), rows[:, 1:4, None]], axis=2)
    with np.load(LOOP_FIXTURE / "reference_depth.npz") as depth:
        samples = {int(name): depth[name] for name in depth.files}
    return LoopScene(tuple(int(f) for f in rows[:, 0]), c2w,
                     np.array([[focal, 0, cx], [0, focal, cy], [0, 0, 1]]), samples,
                     camera["height"], camera["width"])


def registered_frames_folder(scene: LoopScene, folder: Path) -> Path:
    """An image folder of the registered frames (links to the fixture's JPEGs), for a real source."""
    folder.mkdir(parents=True, exist_ok=True)
    for frame in scene.frames:
        (folder / f"{frame:06d}.jpg").symlink_to(scene.image_path(frame))
    return folder


def spread_depth(samples: np.ndarray, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Sparse (x, y, z) -> a depth map (each pixel the nearest sample's depth) and a confidence map that
    is sure only within SURE_RADIUS_PX of a sample."""
    v, u = np.mgrid[0:height, 0:width]
    distance, nearest = cKDTree(samples[:, :2]).query(np.stack([u.ravel(), v.ravel()], axis=1))
    depth = samples[nearest, 2].reshape(height, width).astype(np.float32)
    conf = np.where(distance.reshape(height, width) <= SURE_RADIUS_PX, SURE_CONFIDENCE, UNSURE_CONFIDENCE)
    return depth, conf.astype(np.float32)


def random_drift(rng: np.random.Generator, rotation_deg: float, log_scale: float, translation: float) -> Sim3:
    axis = rng.normal(size=3)
    axis /= np.linalg.norm(axis)
    angle = np.deg2rad(rng.normal(0.0, rotation_deg))
    k = np.array([[0, -axis[2], axis[1]], [axis[2], 0, -axis[0]], [-axis[1], axis[0], 0]])
    rotation = np.eye(3) + np.sin(angle) * k + (1 - np.cos(angle)) * k @ k
    return Sim3(float(np.exp(rng.normal(0.0, log_scale))), rotation, rng.normal(0.0, translation, 3))


def pose_enc_of(c2w: np.ndarray, intrinsics: np.ndarray, height: int, width: int) -> np.ndarray:
    fov_h = 2 * np.arctan(height / 2 / intrinsics[1, 1])
    fov_w = 2 * np.arctan(width / 2 / intrinsics[0, 0])
    return np.concatenate([c2w[:3, 3], rotation_to_quat_xyzw(c2w[:3, :3]), [fov_h, fov_w]]).astype(np.float32)


class LoopSceneEngine:
    """What run_sequence streams through in place of ChunkedEngine (push, finish, stats, close,
    chunk_links), for the loop fixture's registered frames in order.

    `drift`: (rotation degrees, log scale, translation as a fraction of the scene's extent) standard
    deviations of each rollover's alignment error; the link's sigmas say exactly that. `period_s`: how
    long each push takes, as a model would.
    """

    def __init__(self, scene: LoopScene, *, chunk_frames: int = 20, overlap: int = 4,
                 drift: tuple[float, float, float] = (2.0, 0.03, 0.02), seed: int = 0, period_s: float = 0.0):
        self.scene, self.chunk_frames, self.overlap, self.period_s = scene, chunk_frames, overlap, period_s
        centres = scene.c2w[:, :, 3]
        self.extent = float(np.linalg.norm(centres.max(axis=0) - centres.min(axis=0)))
        rng = np.random.default_rng(seed)
        rotation_deg, log_scale, translation = drift
        self.errors = [random_drift(rng, rotation_deg, log_scale, translation * self.extent)
                       for _ in range(len(scene.frames))]
        self.sigmas = np.array([np.deg2rad(rotation_deg)] * 3 + [translation * self.extent] * 3 + [log_scale])
        self.chain = [Sim3.identity()]  # chunk c's emissions are placed by chain[c] (drift of the truth)
        self.chunk_links: list[ChunkLink] = []
        self.chunk_index, self.chunk_start, self.num_frames = 0, 0, 0
        self._depth: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._images: dict[int, np.ndarray] = {}

    slow_first_step = False  # nothing compiles or records: run_sequence's warm-up has nothing to move

    def warm_up(self, image) -> dict[str, float]:
        return {}

    def push(self, image, timestamp: float | None = None) -> list[FramePrediction]:
        started = time.perf_counter()
        index = self.num_frames
        self._images[index] = np.ascontiguousarray(np.asarray(image).transpose(1, 2, 0))
        emitted = []
        if index - self.chunk_start >= self.chunk_frames:
            emitted += self._roll_over(index)
        emitted.append(self._prediction(index, float(index) if timestamp is None else float(timestamp)))
        self.num_frames += 1
        remaining = self.period_s - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return emitted

    def finish(self) -> list[FramePrediction]:
        return []

    def helpers(self) -> dict:
        """It starts no helper (models/supervision.py's HelperOwner, as every owner a run asks)."""
        return {}

    def stats(self) -> dict:
        return {"frames": self.num_frames, "keyframes": self.num_frames, "chunk_index": self.chunk_index,
                "chunk_start": self.chunk_start, "cached_frames": 0, "cache_bytes": 0, "attention": "stand-in"}

    def close(self) -> None:
        """Nothing runs beside it."""

    def _roll_over(self, index: int) -> list[FramePrediction]:
        self.chunk_index += 1
        self.chunk_start = index - self.overlap
        error = self.errors[self.chunk_index]
        self.chain.append(self.chain[-1] @ error)  # the truth is the identity between chunks: all is error
        self.chunk_links.append(ChunkLink(self.chunk_index, error, self.sigmas, self.overlap))
        return [self._prediction(i, float(i)) for i in range(self.chunk_start, index)]

    def _prediction(self, index: int, timestamp: float) -> FramePrediction:
        scene, placement = self.scene, self.chain[self.chunk_index]
        if index not in self._depth:
            self._depth[index] = spread_depth(scene.samples[scene.frames[index]], scene.height, scene.width)
        depth, conf = self._depth[index]
        c2w = placement.apply_to_poses(scene.c2w[index]).astype(np.float32)
        return FramePrediction(
            frame_index=index, timestamp=timestamp,
            frame_type=FRAME_SCALE if index == 0 else FRAME_KEY,
            pose_enc=pose_enc_of(c2w, scene.intrinsics, scene.height, scene.width), c2w=c2w,
            intrinsics=scene.intrinsics.astype(np.float32), depth=depth * np.float32(placement.scale),
            depth_conf=conf, image=self._images[index], chunk_index=self.chunk_index,
        )


def trajectory_error(c2w: np.ndarray, reference: np.ndarray) -> float:
    """Mean camera-centre distance [N, 3, 4] vs [N, 3, 4], in the reference's units (no alignment: the
    stand-in's chunk 0 is the reference's frame)."""
    return float(np.mean(np.linalg.norm(c2w[:, :3, 3] - reference[:, :3, 3], axis=1)))


class StandInModel:
    """What run_sequence is handed when its engine is a LoopSceneEngine: nothing to load or prepare."""

    config = None
    inference_spec = types.SimpleNamespace(compiled=False)


def runs_stream_the_loop_scene(monkeypatch, scene: LoopScene, *, index_spacing: int = 1,
                               **engine_settings) -> list[LoopSceneEngine]:
    """Make runs (app.run.pipeline.run_sequence, handed a StandInModel) stream through a LoopSceneEngine of
    `scene` (LoopSceneEngine's settings), its loop closer indexing one keyframe every `index_spacing`
    frames (default: every keyframe of these short streams) with room for all of them in flight, so that
    what it finds does not depend on how busy the machine is (a detection that falls behind lowers the
    density, by design, rather than hold the stream). Returns the list that each run's engine is
    appended to."""
    from stream_recon.app.run import pipeline
    from stream_recon.app.run.loops import LoopClosureSink
    from stream_recon.models.loops.closer import LoopClosureConfig

    engines: list[LoopSceneEngine] = []

    def build_stand_in(*_args, **_kwargs) -> LoopSceneEngine:
        engines.append(LoopSceneEngine(scene, **engine_settings))
        return engines[-1]

    class EveryKeyframe(LoopClosureSink):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, config=LoopClosureConfig(keyframes_in_flight=100, index_spacing=index_spacing),
                             **kwargs)

    monkeypatch.setattr(pipeline, "build_engine", build_stand_in)
    monkeypatch.setattr(pipeline, "LoopClosureSink", EveryKeyframe)
    return engines
