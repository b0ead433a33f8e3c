"""Query frames placed in a finished run's map, one at a time, as loop closure places a revisit.

A query is what a keyframe of the map holds (saved_map.MapKeyframe), made of one frame the model has seen:
its retrieval descriptor, its SIFT features, the point behind each keypoint in the query's own world (the
model's depth through its own pose) and that pose. Its verdict comes in the stages loop closure goes
through, with the reason of the stage that stopped it:

1. retrieval (retrieval.KeyframeIndex): the map's keyframes that look alike, every chunk of the map
   eligible (the query comes after the run);
2. the geometric check of each (geometric_check.check_pair): enough mutual matches, an essential matrix;
3. the 3D agreement of the two depths at the inlier matches (closer.align_loop): a Sim(3) from the
   query's world onto the map's, its scale within the drift's bounds;
4. look-alikes: a second keyframe that verifies as well and puts the query elsewhere (farther than
   `look_alike_distance` of the scene's depth) means the map holds two places the query fits: not placed.

The placed pose is the query's own pose through the best keyframe's Sim(3) (the most agreeing points).
The keyframes are taken in whatever world the caller gives them (`keyframe_moved` carries a keyframe into
another, the run's files' where a solve or a refine moved them); the pose comes out in that world.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..stream.prediction import FramePrediction
from ..stream.similarity import Sim3
from .closer import LoopAlignment, LoopClosureConfig, _KeyframePoints, align_loop, keyframe_of, map_manifest
from .geometric_check import NOT_FITTED, ImageFeatures, check_pair
from .refine import indexed_keyframe
from .retrieval import KeyframeIndex, LoopCandidate, gradient_grid_descriptor
from .saved_map import MapKeyframe, SavedMap, refusal

PLACED = "placed"
NOT_RETRIEVED = "no keyframe of the map looks alike"
FEW_MATCHES = "too few feature matches with the nearest keyframes"
GEOMETRY_FAILED = "the geometric check failed: the matches fit no camera motion"
POINTS_DISAGREE = "the 3D points disagree with the matched keyframes'"
LOOK_ALIKE = "look-alike: two places of the map fit it"


@dataclass(frozen=True)
class LocaliseConfig:
    closure: LoopClosureConfig = LoopClosureConfig()
    # Keyframes retrieved for a query, each a geometric check (~10-30 ms on a CPU core): more than the
    # stream's 3, as a query has no later keyframe to find the place again with.
    candidates: int = 5
    # Two verified keyframes that place the query farther apart than this share of the better one's median
    # depth tell of two places, not of one place's drift: in a run whose loops were closed, its keyframes of
    # one place agree within a few % of the depth (LoopClosureConfig.agreement_distance, 5 %).
    look_alike_distance: float = 0.5
    # ... when the other has at least this share of the better one's agreeing points (a weaker one that
    # verified is a lesser match of the same kind, and the better stands)
    look_alike_share: float = 0.5

    def __post_init__(self) -> None:
        if self.candidates < 1 or self.look_alike_distance <= 0 or not 0 < self.look_alike_share <= 1:
            raise ValueError(f"invalid localise config {self}")


@dataclass(frozen=True)
class QueryFrame:
    """One query frame as the map's keyframes are held."""

    descriptor: np.ndarray  # [D] the map's kind of retrieval descriptor
    features: ImageFeatures
    intrinsics: np.ndarray  # [3, 3] in the query image's pixels
    points: np.ndarray  # [N, 3] the point behind each keypoint, the query's world; NaN where unsure
    median_depth: float
    c2w: np.ndarray  # [3 or 4, 4] the query camera in its own world


@dataclass(frozen=True)
class Verdict:
    """Where a query stands in the map, or why it was not placed."""

    placed: bool
    reason: str  # PLACED, or one of the reasons above (with a detail for look-alikes)
    c2w: np.ndarray | None = None  # [3, 4] in the keyframes' world, when placed
    map_from_query: Sim3 | None = None  # the query's world onto the keyframes'
    keyframe: int | None = None  # the map keyframe it was placed against (or the best one tried)
    similarity: float = float("nan")
    retrieved: int = 0
    matches: int = 0
    inliers: int = 0
    agreeing: int = 0
    rms: float = float("nan")  # of the agreeing points' residuals, in the keyframe's median depth

    def as_json(self) -> dict[str, Any]:
        def rounded(value: float) -> float | None:
            return round(float(value), 5) if np.isfinite(value) else None

        out: dict[str, Any] = {"placed": self.placed, "reason": self.reason, "keyframe": self.keyframe,
                               "similarity": rounded(self.similarity), "retrieved": self.retrieved,
                               "matches": self.matches, "inliers": self.inliers, "agreeing": self.agreeing,
                               "rms_relative": rounded(self.rms)}
        if self.map_from_query is not None:
            out["scale"] = rounded(self.map_from_query.scale)
        return out


@dataclass(frozen=True)
class _Tried:
    candidate: LoopCandidate
    matches: int
    inliers: int
    fitted: bool  # the check had matches enough to fit its geometry (not geometric_check's NOT_FITTED)
    alignment: LoopAlignment | None  # when the check passed


class MapLocaliser:
    """A map's keyframes indexed once; `place` gives each query its verdict."""

    def __init__(self, keyframes: Sequence[MapKeyframe], config: LocaliseConfig = LocaliseConfig()):
        if not keyframes:
            raise ValueError("a map without keyframes places nothing")
        self.config = config
        self._keyframes = {keyframe.frame_index: keyframe for keyframe in keyframes}
        self._index = KeyframeIndex(len(keyframes[0].descriptor), len(keyframes))
        for keyframe in keyframes:
            self._index.add(keyframe.descriptor, keyframe.frame_index, keyframe.chunk_index)
        retrieval = config.closure.detection.retrieval
        self._retrieval = replace(retrieval, top_k=config.candidates)
        # every chunk eligible: the query stands past the map's last chunk by the index's exclusion
        self._after_last_chunk = max(keyframe.chunk_index for keyframe in keyframes) + retrieval.excluded_chunks

    def nearest(self, descriptor: np.ndarray) -> list[LoopCandidate]:
        """The map's keyframes that look like `descriptor`, best first (retrieval's rules, every chunk)."""
        return self._index.candidates(descriptor, self._after_last_chunk, self._retrieval)

    def nearest_to_picture(self, image: np.ndarray) -> list[LoopCandidate]:
        """`nearest` for a picture [H, W, 3] uint8 (the weight-free descriptor: a map that `map_refusal`
        passed is indexed with it), before any model has seen it."""
        return self.nearest(gradient_grid_descriptor(image))

    def place(self, query: QueryFrame) -> Verdict:
        """The query's verdict (the module docstring's stages); its pose in the keyframes' world when placed."""
        candidates = self.nearest(query.descriptor)
        if not candidates:
            return Verdict(False, NOT_RETRIEVED)
        tried = [self._try(query, candidate) for candidate in candidates]
        verified = [item for item in tried if item.alignment is not None and item.alignment.passed]
        if not verified:
            return self._refused(tried)
        best = max(verified, key=lambda item: item.alignment.agreeing)
        placed = replace(self._placement(query, best), retrieved=len(candidates))
        rival = self._rival(query, best, verified)
        if rival is not None:
            apart = float(np.linalg.norm(self._placement(query, rival).c2w[:3, 3] - placed.c2w[:3, 3]))
            return replace(placed, placed=False, c2w=None, map_from_query=None,
                           reason=f"{LOOK_ALIKE} (keyframes {best.candidate.frame_index} and "
                                  f"{rival.candidate.frame_index} put it {apart:.3g} apart)")
        return placed

    def _try(self, query: QueryFrame, candidate: LoopCandidate) -> _Tried:
        keyframe = self._keyframes[candidate.frame_index]
        closure = self.config.closure
        check = check_pair(query.features, ImageFeatures(keyframe.keypoints, keyframe.descriptors), query.intrinsics,
                           keyframe.intrinsics, closure.detection.check)
        fitted = check.geometry != NOT_FITTED
        if not check.passed:
            return _Tried(candidate, check.matches, check.inliers, fitted, None)
        # The query's world has a scale of its own (the model's depth normalisation of a run of a few frames):
        # brought to the keyframe's by the two median depths first, so that the fit's scale bound
        # (max_scale_change) judges what is left, as between two chunks of one stream.
        rescaled = Sim3(keyframe.median_depth / query.median_depth, np.eye(3), np.zeros(3))
        if not np.isfinite(rescaled.scale) or rescaled.scale <= 0:
            unsure = LoopAlignment(Sim3.identity(), 0, 0, float("nan"), np.full(7, np.inf), False)
            return _Tried(candidate, check.matches, check.inliers, True, unsure)
        points = rescaled.apply_to_points(np.asarray(query.points, np.float64))
        centre = rescaled.apply_to_points(np.asarray(query.c2w, np.float64)[:3, 3])
        alignment = align_loop(_KeyframePoints(points, keyframe.median_depth, centre),
                               _KeyframePoints(keyframe.points, keyframe.median_depth, keyframe.c2w[:3, 3]),
                               check.inlier_matches, closure)
        return _Tried(candidate, check.matches, check.inliers, True,
                      replace(alignment, earlier_from_query=alignment.earlier_from_query @ rescaled))

    def _placement(self, query: QueryFrame, item: _Tried) -> Verdict:
        fit = item.alignment.earlier_from_query
        c2w = fit.apply_to_poses(np.asarray(query.c2w, np.float64)[:3])
        return Verdict(True, PLACED, c2w, fit, item.candidate.frame_index, item.candidate.similarity, 0,
                       item.matches, item.inliers, item.alignment.agreeing, item.alignment.rms)

    def _rival(self, query: QueryFrame, best: _Tried, verified: list[_Tried]) -> _Tried | None:
        """The strongest other verified keyframe that puts the query elsewhere, if one does."""
        config = self.config
        here = self._placement(query, best).c2w[:3, 3]
        reach = config.look_alike_distance * self._keyframes[best.candidate.frame_index].median_depth
        rivals = [item for item in verified if item is not best
                  and item.alignment.agreeing >= config.look_alike_share * best.alignment.agreeing
                  and np.linalg.norm(self._placement(query, item).c2w[:3, 3] - here) > reach]
        return max(rivals, key=lambda item: item.alignment.agreeing, default=None)

    def _refused(self, tried: list[_Tried]) -> Verdict:
        """Not placed: the reason of the farthest stage any candidate reached, with the best such candidate's
        figures."""
        checked = [item for item in tried if item.alignment is not None]
        fitted = [item for item in tried if item.fitted]
        if checked:
            reason, pool = POINTS_DISAGREE, checked
        elif fitted:
            reason, pool = GEOMETRY_FAILED, fitted
        else:
            reason, pool = FEW_MATCHES, tried
        best = max(pool, key=lambda item: (item.inliers, item.matches))
        agreeing = best.alignment.agreeing if best.alignment is not None else 0
        rms = best.alignment.rms if best.alignment is not None else float("nan")
        return Verdict(False, reason, None, None, best.candidate.frame_index, best.candidate.similarity, len(tried),
                       best.matches, best.inliers, agreeing, rms)


def query_of(prediction: FramePrediction, config: LocaliseConfig = LocaliseConfig()) -> QueryFrame:
    """A query frame from the model's prediction of it (its picture, depth and pose in the prediction's world),
    made as refine indexes a keyframe."""
    indexed = indexed_keyframe(keyframe_of(prediction), config.closure)
    return QueryFrame(indexed.descriptor, indexed.features, indexed.intrinsics, indexed.points.points,
                      indexed.points.median_depth, np.asarray(prediction.c2w, np.float64))


def map_refusal(saved: SavedMap, checkpoint: Mapping[str, Any], config: LocaliseConfig = LocaliseConfig()) -> str | None:
    """Why `saved` cannot place frames of the model `checkpoint` (name, bytes, sha256) with this version's
    descriptor and features, in one line; None when it can."""
    wanted = map_manifest(config.closure, checkpoint, saved.manifest.chunk_frames, saved.manifest.overlap)
    return refusal(saved.manifest, wanted, saved.path)


def keyframe_in_world(keyframe: MapKeyframe, c2w: np.ndarray, median_depth: float) -> MapKeyframe | None:
    """The keyframe carried into a world where its camera is `c2w` and its median confident depth `median_depth`
    (a run's files, which a solve or a refine moved by a Sim(3), depth scaled); None where either depth is not
    a positive number (nothing of it could be matched in 3D)."""
    scale = median_depth / keyframe.median_depth
    if not (np.isfinite(scale) and scale > 0):
        return None
    c2w = np.asarray(c2w, np.float64)
    rotation = c2w[:3, :3] @ keyframe.c2w[:3, :3].T
    return keyframe_moved(keyframe, Sim3(scale, rotation, c2w[:3, 3] - scale * rotation @ keyframe.c2w[:3, 3]))


def keyframe_moved(keyframe: MapKeyframe, move: Sim3) -> MapKeyframe:
    """The keyframe in another world, `move` taking its world there: its camera and points moved, its depth
    scaled."""
    return replace(keyframe, c2w=move.apply_to_poses(keyframe.c2w), points=move.apply_to_points(keyframe.points),
                   median_depth=keyframe.median_depth * move.scale)


__all__ = ["FEW_MATCHES", "GEOMETRY_FAILED", "LOOK_ALIKE", "LocaliseConfig", "MapLocaliser", "NOT_RETRIEVED",
           "PLACED", "POINTS_DISAGREE", "QueryFrame", "Verdict", "keyframe_in_world", "keyframe_moved",
           "map_refusal", "query_of"]
