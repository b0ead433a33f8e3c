"""The saved map: what a run keeps so that its map can be reopened (refined, extended, localised in).

A run with loop closure writes it into its folder as the stream goes, one file at a time, each written whole
(a temporary file renamed over its name), so that a run killed at any instant leaves a map that reads back up
to its last complete chunk::

    RUN_DIR/map/
      map.json                 the manifest: format, checkpoint (name, bytes, sha256 once hashed), settings
                               (descriptor, features, chunk frames and overlap), written by the stream's process
      links/000001.npz         chunk 1 on chunk 0: previous_from_next [4, 4], covariance [7, 7] (a chunk aligned
                               again rewrites its file)
      keyframes/000048.npz     an indexed keyframe: frame and chunk index, c2w [3, 4] as emitted (the open chain's
                               world), intrinsics, image size, the retrieval descriptor, SIFT keypoints [N, 2] and
                               descriptors [N, 128] uint8, the emitted world point behind each keypoint [N, 3]
                               (NaN where the depth was not confident), the frame's median depth
      loops/000007.npz         a verified loop edge: chunks, first_from_second [4, 4], covariance [7, 7], the two
                               keyframes, its id
      solved.npz               the last solve of the run's end: world_from_chunk [K, 4, 4], the accepted loops' ids;
                               present only when the run's loop closer finished

The loop-closure child writes links, keyframes, loops and the solve (it has the features already); the
stream's process writes the manifest. Reading (`read_map`) keeps the chunks that are complete: all of them
when solved.npz is there, else those a link two chunks later proves closed (a chunk's last keyframes are
emitted up to the next chunk's start), and the keyframes, links and loops within them. `refusal` says in one
line why a map cannot serve a run (another format, checkpoint, descriptor or features), or None.

NumPy only: the app reads a map without GTSAM, OpenCV or torch.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import zipfile
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..stream.similarity import Sim3

MAP_DIR = "map"
MAP_FORMAT = "stream-recon-map/1"
MANIFEST = "map.json"
SOLVED = "solved.npz"
_NAME = re.compile(r"^(\d{6,})\.npz$")
_KINDS = ("links", "keyframes", "loops")


class MapError(ValueError):
    """A map that is missing, unreadable, or cannot serve the run asking for it; one sentence that says what
    to do."""


@dataclass(frozen=True)
class MapManifest:
    """map.json: what produced the map and what a run must share with it to use it."""

    checkpoint: Mapping[str, Any]  # name, bytes, sha256 (None until hashed)
    descriptor: str  # the retrieval descriptor: "gradient-grid/128" or "model/<dim>"
    features: str  # "sift/<max features>/<contrast threshold>"
    chunk_frames: int
    overlap: int
    format: str = MAP_FORMAT
    # the earlier run whose map this one extends (`run --map`): solved.npz's chunks are then in that map's
    # frame once the stream was placed in it (run.json's summary.loop_closure.map says whether)
    extends: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"format": self.format, "checkpoint": dict(self.checkpoint), "descriptor": self.descriptor,
                "features": self.features, "chunk_frames": self.chunk_frames, "overlap": self.overlap,
                **({"extends": self.extends} if self.extends is not None else {})}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MapManifest:
        return cls(dict(data["checkpoint"]), str(data["descriptor"]), str(data["features"]), int(data["chunk_frames"]),
                   int(data["overlap"]), str(data["format"]), data.get("extends"))


def write_manifest(map_dir: Path, manifest: MapManifest) -> None:
    _write_whole(Path(map_dir) / MANIFEST, json.dumps(manifest.as_json(), indent=2).encode())


def refusal(manifest: MapManifest, wanted: MapManifest, where: Path) -> str | None:
    """Why the map at `where` cannot serve a run that would write `wanted`, in one line; None when it can."""
    if manifest.format != MAP_FORMAT:
        return f"{where} is a map of format {manifest.format!r}; this version reads {MAP_FORMAT!r}: run the video again"
    refused = checkpoint_refusal(manifest.checkpoint, wanted.checkpoint, where)
    if refused is not None:
        return refused
    for what in ("descriptor", "features"):
        if getattr(manifest, what) != getattr(wanted, what):
            return (f"{where} was indexed with {what} {getattr(manifest, what)}, this run uses "
                    f"{getattr(wanted, what)}: run with the map's settings")
    return None


def checkpoint_refusal(made_with: Mapping[str, Any], wanted: Mapping[str, Any], where: Path) -> str | None:
    """Why the map at `where`, made with checkpoint `made_with`, cannot serve a run of checkpoint `wanted` (each
    its name, bytes and sha256, as far as known), in one line; None when they may be the same. The digests
    decide where both are known; else the name and the size, each where both know it (a run killed before its
    checkpoint was hashed; a run checked before it loads its own)."""
    if made_with.get("sha256") and wanted.get("sha256"):
        same = made_with["sha256"] == wanted["sha256"]
    else:
        same = all(None in (made_with.get(key), wanted.get(key)) or made_with[key] == wanted[key]
                   for key in ("name", "bytes"))
    if same:
        return None
    known = "sha256" if made_with.get("sha256") and wanted.get("sha256") else "bytes"
    return (f"{where} was made with checkpoint {made_with.get('name')} ({known} {str(made_with.get(known))[:12]}), "
            f"not {wanted.get('name')} ({known} {str(wanted.get(known))[:12]}): give the same --checkpoint")


# -- the child's side: written as the stream goes ------------------------------------------------------
class MapRecorder:
    """Writes a stream's map files into `map_dir` as loop closure makes them (see the module docstring)."""

    def __init__(self, map_dir: Path):
        self.map_dir = Path(map_dir)
        for kind in _KINDS:
            (self.map_dir / kind).mkdir(parents=True, exist_ok=True)

    def link(self, index: int, previous_from_next: np.ndarray, covariance: np.ndarray) -> None:
        self._npz("links", index, index=index, previous_from_next=previous_from_next, covariance=covariance)

    def keyframe(self, frame_index: int, chunk_index: int, c2w: np.ndarray, intrinsics: np.ndarray,
                 image_size: tuple[int, int], descriptor: np.ndarray, keypoints: np.ndarray,
                 descriptors: np.ndarray, points: np.ndarray, median_depth: float) -> None:
        self._npz("keyframes", frame_index, frame_index=frame_index, chunk_index=chunk_index,
                  c2w=np.asarray(c2w, np.float64)[:3], intrinsics=intrinsics, image_size=np.asarray(image_size),
                  descriptor=np.asarray(descriptor, np.float32), keypoints=keypoints, descriptors=descriptors,
                  points=np.asarray(points, np.float64), median_depth=median_depth)

    def loop(self, number: int, loop_id: Hashable, first: int, second: int, first_from_second: np.ndarray,
             covariance: np.ndarray, frames: tuple[int, int]) -> None:
        self._npz("loops", number, loop_id=str(loop_id), first=first, second=second,
                  first_from_second=first_from_second, covariance=covariance, frames=np.asarray(frames))

    def solved(self, world_from_chunk: np.ndarray, accepted: list[Hashable]) -> None:
        self._write(SOLVED, world_from_chunk=world_from_chunk, accepted=np.array([str(i) for i in accepted]))

    def _npz(self, kind: str, number: int, **arrays: Any) -> None:
        self._write(f"{kind}/{number:06d}.npz", **arrays)

    def _write(self, name: str, **arrays: Any) -> None:
        target = self.map_dir / name
        handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as file:
                np.savez(file, **{key: np.asarray(value) for key, value in arrays.items()})
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise


def _write_whole(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


# -- reading ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MapKeyframe:
    frame_index: int
    chunk_index: int
    c2w: np.ndarray  # [3, 4] in the open chain's world
    intrinsics: np.ndarray  # [3, 3]
    image_size: tuple[int, int]  # (height, width)
    descriptor: np.ndarray  # [D] float32
    keypoints: np.ndarray  # [N, 2] float32
    descriptors: np.ndarray  # [N, 128] uint8
    points: np.ndarray  # [N, 3] float64, the open chain's world, NaN where unsure
    median_depth: float


@dataclass(frozen=True)
class MapLoop:
    loop_id: str
    first: int
    second: int
    first_from_second: np.ndarray  # [4, 4]
    covariance: np.ndarray  # [7, 7]
    frames: tuple[int, int]  # (earlier keyframe, query keyframe)


@dataclass(frozen=True)
class SavedMap:
    """A map read back: its complete chunks and what lies within them."""

    path: Path
    manifest: MapManifest
    num_chunks: int  # complete chunks (0: none yet)
    links: list[tuple[np.ndarray, np.ndarray]]  # links[c - 1]: chunk c on chunk c - 1 (previous_from_next, covariance)
    keyframes: list[MapKeyframe]  # frame order
    loops: list[MapLoop]
    complete: bool  # the run's loop closer finished (solved.npz)
    solved: np.ndarray | None = None  # [K, 4, 4] its last solve, when complete
    accepted: tuple[str, ...] = field(default_factory=tuple)

    def open_chain(self) -> list[Sim3]:
        """Each complete chunk's open-chain placement: the links composed from chunk 0."""
        chain = [Sim3.identity()]
        for previous_from_next, _ in self.links:
            chain.append(chain[-1] @ Sim3.from_matrix(previous_from_next))
        return chain[:self.num_chunks]

    def placement(self, corrected: bool) -> list[Sim3]:
        """Each complete chunk in the run's outputs: the run's last solve where it `corrected` its files (the
        run left trajectory_open_tum.txt beside them), else the open chain."""
        if corrected and self.solved is not None:
            return [Sim3.from_matrix(matrix) for matrix in self.solved[:self.num_chunks]]
        return self.open_chain()


def has_map(run_dir: Path) -> bool:
    return (Path(run_dir) / MAP_DIR / MANIFEST).is_file()


def read_manifest(run_dir: Path) -> MapManifest:
    path = Path(run_dir) / MAP_DIR / MANIFEST
    if not path.is_file():
        raise MapError(f"{run_dir} holds no map ({MAP_DIR}/{MANIFEST} is missing): maps are written by runs with "
                       "loop closure (--loop-closure on); run the video again with it")
    try:
        return MapManifest.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise MapError(f"{path} cannot be read ({type(error).__name__}: {error}): run the video again") from None


def read_map(run_dir: Path) -> SavedMap:
    """The map of `run_dir` up to its last complete chunk; MapError when it has none or it cannot be read."""
    map_dir = Path(run_dir) / MAP_DIR
    manifest = read_manifest(run_dir)
    if manifest.format != MAP_FORMAT:
        raise MapError(refusal(manifest, manifest, map_dir))
    try:
        links = _numbered(map_dir / "links")
        solved_path = map_dir / SOLVED
        complete = solved_path.is_file()
        solved = accepted = None
        if complete:
            with np.load(solved_path) as data:
                solved, accepted = data["world_from_chunk"].copy(), tuple(str(i) for i in data["accepted"])
        # chunk c is closed once chunk c + 2 has a link; with the solve written, every linked chunk is
        chunks = len(links) + 1 if complete else max(len(links) - 1, 0)
        chain = []
        for index in range(1, chunks):
            if index not in links:
                break
            with np.load(links[index]) as data:
                chain.append((data["previous_from_next"].copy(), data["covariance"].copy()))
        chunks = min(chunks, len(chain) + 1)
        keyframes = [_keyframe(path) for _, path in sorted(_numbered(map_dir / "keyframes").items())]
        keyframes = [keyframe for keyframe in keyframes if keyframe.chunk_index < chunks]
        loops = [_loop(path) for _, path in sorted(_numbered(map_dir / "loops").items())]
        loops = [loop for loop in loops if max(loop.first, loop.second) < chunks]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as error:
        raise MapError(f"{map_dir} cannot be read ({type(error).__name__}: {error}): run the video again") from None
    return SavedMap(map_dir, manifest, chunks, chain, keyframes, loops, complete,
                    solved if complete and solved is not None and len(solved) == len(chain) + 1 else None,
                    accepted or ())


def _numbered(folder: Path) -> dict[int, Path]:
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = _NAME.match(path.name)
        if match:
            found[int(match.group(1))] = path
    return found


def _keyframe(path: Path) -> MapKeyframe:
    with np.load(path) as data:
        return MapKeyframe(int(data["frame_index"]), int(data["chunk_index"]), data["c2w"].copy(),
                           data["intrinsics"].copy(), tuple(int(v) for v in data["image_size"]),
                           data["descriptor"].copy(), data["keypoints"].copy(), data["descriptors"].copy(),
                           data["points"].copy(), float(data["median_depth"]))


def _loop(path: Path) -> MapLoop:
    with np.load(path) as data:
        return MapLoop(str(data["loop_id"]), int(data["first"]), int(data["second"]), data["first_from_second"].copy(),
                       data["covariance"].copy(), tuple(int(v) for v in data["frames"]))


__all__ = ["MAP_DIR", "MAP_FORMAT", "MapError", "MapKeyframe", "MapLoop", "MapManifest", "MapRecorder", "SavedMap",
           "checkpoint_refusal", "has_map", "read_manifest", "read_map", "refusal", "write_manifest"]
