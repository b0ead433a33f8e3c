"""The speed a user gets: `stream-recon VIDEO` (app.run.pipeline.run_sequence) on a real video file, every
output written, beside the engine's own rate measured in the same process.

    python scripts/bench_e2e.py                          # a 1,000-frame 640x468 video made from app/sample
    python scripts/bench_e2e.py clip.mp4 --keyframes flow --viewer --client
    python scripts/bench_e2e.py --model tiny --device cpu --frames 40 --json out.json   # smoke test (CPU)
    python scripts/bench_e2e.py --stand-in-ms 25 --viewer --client   # no model: the product path's own cost

One process, in this order: make (or open) the video; build the model (synthetic weights as scripts/bench.py
builds them, or --checkpoint); run run_sequence on the video into a temporary run directory, with an extra
sink that records when each prediction is delivered; then time the engine alone on the same frames,
decoded and preprocessed beforehand, with the same options.

Frame interval: the time between deliveries of consecutive new frames to the sinks. Steady state: the
frames after the first scale + window frames. A stall: an interval over STALL_FACTOR x the median; the
longest one is reported with its frame and whether a chunk rollover happened there. At a rollover:
the longest interval in the frames a rollover's work can reach (`rollover_regions`: from the overlap
before it, where a spare starts the next chunk, to the frames the closed chunk predicted
provisionally after it). Main-thread time
besides the engine: between the return of one `engine.push` and the next call (reading the next frame,
the sinks' on_frame, the progress line), measured by a thin wrapper around the engine.

--stand-in-ms replaces the model by a stand-in engine (StandInEngine below, not a model) that returns
full-size predictions of a synthetic scene at a fixed rate, waiting the way a GPU-bound push waits (without
the GIL); it measures what the sinks, the source and the loop cost around an engine of that speed.

Prints a table and writes JSON (--json) with at least: steady_fps, engine_fps, p50_ms, p99_ms,
first_prediction_s, longest_stall_ms, bytes_per_frame, host_rss_gb.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import gc
import json
import logging
import os
import resource
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROCESS_IMPORTED_AT = time.time()

import cv2  # noqa: E402
import numpy as np  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SAMPLE_FRAMES = REPO / "app" / "sample"
STALL_FACTOR = 3.0
LOOKAHEAD = {"auto": None, "on": True, "off": False}  # --lookahead: ChunkedEngine's lookahead


def process_start_time() -> float:
    """Unix time this process started (Linux: /proc); the time this script was imported elsewhere."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime_s + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return PROCESS_IMPORTED_AT


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class ThreadTimeline:
    """What the main thread and the dry pass ahead ("kernel-build-ahead") run, sampled every `period_s`
    from construction until `stop`: each sample labelled by the deepest function of this project on the
    stack (module.function) and the call path below it (where the time goes: a library's functions, or
    the C call they made); and, for the threads that build Triton kernels ("kernel-build*"), their
    innermost frame. A thread that holds the interpreter delays a sample; the labels still say which
    code ran."""

    SEGMENTED = ("MainThread", "kernel-build-ahead")

    def __init__(self, period_s: float = 0.01) -> None:
        self.samples: dict[str, list[tuple[float, str, str]]] = {name: [] for name in self.SEGMENTED}
        self.builders: dict[str, int] = {}  # innermost frame of a building thread -> samples
        self._period_s = period_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="timeline", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stopped.wait(self._period_s):
            names = {thread.ident: thread.name for thread in threading.enumerate()}
            now = time.perf_counter()
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, "")
                if name in self.samples:
                    self.samples[name].append((now, *self._labels(frame)))
                elif name.startswith("kernel-build"):
                    innermost = self._labels(frame, depth=1)[1]
                    self.builders[innermost] = self.builders.get(innermost, 0) + 1

    @staticmethod
    def _labels(frame: types.FrameType, depth: int = 8) -> tuple[str, str]:
        """(the deepest function of this project, the call path below it: its innermost `depth` frames)."""
        path, ours = [], "(outside stream_recon)"
        while frame is not None:
            module = frame.f_globals.get("__name__", "?")
            label = f"{module}.{frame.f_code.co_name}"
            if module.startswith("stream_recon."):
                ours = label.removeprefix("stream_recon.")
                break
            if not module.startswith("importlib._bootstrap"):
                path.append(label)
            elif not path or path[-1] != "(import)":
                path.append("(import)")
            frame = frame.f_back
        return ours, " < ".join(path[:depth]) or ours

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def summary(self, origin: float, until: float, min_s: float = 0.1) -> dict[str, Any]:
        """Per segmented thread, its runs of one `ours` label before `until` of at least `min_s`, as
        {start s after `origin`, seconds, label, the most sampled call path below it}; and the building
        threads' most sampled innermost frames, in seconds of samples."""
        result: dict[str, Any] = {}
        for name, samples in self.samples.items():
            runs: list[list] = []
            for at, ours, innermost in samples:
                if at > until:
                    break
                if runs and runs[-1][2] == ours:
                    runs[-1][1] = at
                    runs[-1][3][innermost] = runs[-1][3].get(innermost, 0) + 1
                else:
                    runs.append([at, at, ours, {innermost: 1}])
            result[name] = [{"at_s": round(start - origin, 2), "s": round(end - start, 2), "ours": ours,
                             "innermost": max(inner, key=inner.get)}
                            for start, end, ours, inner in runs if end - start >= min_s]
        top = sorted(self.builders.items(), key=lambda item: -item[1])[:12]
        result["building_threads_s"] = {label: round(count * self._period_s, 2) for label, count in top}
        return result


# ---------------------------------------------------------------------------------------- the video


def make_video(path: Path, num_frames: int, width: int, height: int, fps: float = 30.0) -> Path:
    """A video of `num_frames` frames from the repository's sample frames: the 14 frames played forwards
    and backwards (ping-pong), each held for 4 output frames while a crop window pans slowly over it, so
    that consecutive frames differ by a few pixels of real image motion."""
    sources = [cv2.imread(str(p)) for p in sorted(SAMPLE_FRAMES.glob("*.png"))]
    margin = 48  # pixels the crop window can move in each direction
    canvas_w, canvas_h = width + 2 * margin, height + 2 * margin
    canvases = [cv2.resize(frame, (canvas_w, canvas_h), interpolation=cv2.INTER_CUBIC) for frame in sources]
    cycle = list(range(len(canvases))) + list(range(len(canvases) - 2, 0, -1))  # 0..13..1
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write an mp4v video to {path}")
    for index in range(num_frames):
        canvas = canvases[cycle[(index // 4) % len(cycle)]]
        angle = 2 * np.pi * index / 240
        x = int(round(margin + margin * np.cos(angle)))
        y = int(round(margin + margin * np.sin(angle)))
        writer.write(canvas[y : y + height, x : x + width])
    writer.release()
    return path


def make_scene_video(path: Path, scene: Path, num_frames: int, width: int, height: int, fps: float = 30.0,
                     order: str = "pingpong") -> Path:
    """A video of `num_frames` frames from a recorded scene (a folder of images in name order, or a video),
    each centre-cropped to the aspect of `width` x `height` and resized to it, in the `order` of
    `scene_order`. Every order passes the same places again and again, so a scene of a few dozen or
    hundred frames becomes a long video that keeps revisiting."""
    frames = _scene_frames(scene)
    if len(frames) < 2:
        raise ValueError(f"{scene}: a scene needs at least 2 frames, found {len(frames)}")
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write an mp4v video to {path}")
    fitted = [_crop_to(frame, width, height) for frame in frames]
    for index in scene_order(order, len(frames), num_frames):
        writer.write(fitted[index])
    writer.release()
    return path


def scene_order(order: str, scene_frames: int, num_frames: int) -> list[int]:
    """Which scene frame each of `num_frames` output frames shows:
    - `pingpong`: forwards and backwards, again and again;
    - `walk:SEED`: a seeded random walk over the first 40 frames (or all, if fewer), each step one frame
      forwards or backwards, each frame held 3 output frames: every place is revisited at random;
    - `tour:LAPS`: forwards through the whole scene LAPS times in the video (a scene that ends where it
      began, such as a loop around a building, closes one loop a lap), each frame held as long as fits."""
    kind, _, value = order.partition(":")
    if kind == "pingpong":
        cycle = list(range(scene_frames)) + list(range(scene_frames - 2, 0, -1))
        return [cycle[index % len(cycle)] for index in range(num_frames)]
    if kind == "walk":
        rng = np.random.default_rng(int(value or 0))
        span, position, out = min(scene_frames, 40), 0, []
        while len(out) < num_frames:
            out += [position] * 3
            position = int(np.clip(position + rng.choice((-1, 1)), 0, span - 1))
        return out[:num_frames]
    if kind == "tour":
        laps = int(value or 1)
        return [min(scene_frames - 1, index * laps * scene_frames // num_frames % scene_frames)
                for index in range(num_frames)]
    raise ValueError(f"unknown scene order {order!r}: pingpong, walk:SEED or tour:LAPS")


def _scene_frames(scene: Path) -> list[np.ndarray]:
    if scene.is_dir():
        names = sorted(p for p in scene.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
        return [cv2.imread(str(p)) for p in names]
    capture = cv2.VideoCapture(str(scene))
    frames = []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        frames.append(frame)
    capture.release()
    return frames


def _crop_to(frame: np.ndarray, width: int, height: int) -> np.ndarray:
    """The largest centred crop of `frame` with the aspect width:height, resized to width x height."""
    rows, cols = frame.shape[:2]
    crop_cols = min(cols, round(rows * width / height))
    crop_rows = min(rows, round(cols * height / width))
    top, left = (rows - crop_rows) // 2, (cols - crop_cols) // 2
    crop = frame[top : top + crop_rows, left : left + crop_cols]
    return cv2.resize(crop, (width, height), interpolation=cv2.INTER_AREA if crop_cols > width else cv2.INTER_CUBIC)


# ---------------------------------------------------------------------------------- measuring sinks


@dataclass
class Deliveries:
    """What reached the sinks: (time, frame index, chunk index) per emission, and the run's stats."""

    times: list[float] = field(default_factory=list)
    frames: list[int] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)
    rollovers: list[int] = field(default_factory=list)  # engine's rollover count at each emission
    provisional: list[bool] = field(default_factory=list)  # a closed chunk's emission, emitted again later
    rss: list[int] = field(default_factory=list)


class DeliveryRecorder:
    """An extra sink: when each prediction reaches the sinks (it is called after the run's own writer)."""

    def __init__(self) -> None:
        self.deliveries = Deliveries()
        self.image_size: tuple[int, int] | None = None

    def on_frame(self, pred: Any, stats: dict) -> None:
        self.image_size = self.image_size or tuple(pred.depth.shape)
        d = self.deliveries
        d.times.append(time.perf_counter())
        d.frames.append(int(pred.frame_index))
        d.chunks.append(int(getattr(pred, "chunk_index", 0)))
        d.rollovers.append(int(stats.get("rollovers") or 0))
        d.provisional.append(bool(getattr(pred, "provisional", False)))
        if len(d.frames) % 25 == 1:
            d.rss.append(rss_bytes())

    def close(self, status: str) -> None:
        """Nothing to release."""


class TimedEngine:
    """Wraps an engine: records when each push starts and returns, so that the main thread's time
    besides the engine (between a return and the next call) can be told apart."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.calls: list[tuple[float, float]] = []

    def push(self, image: Any, timestamp: float | None = None) -> list:
        start = time.perf_counter()
        try:
            return self._engine.push(image, timestamp=timestamp)
        finally:
            self.calls.append((start, time.perf_counter()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def outside_ms(self, skip: int) -> list[float]:
        """ms between the return of push i and the call of push i + 1, for i >= skip."""
        return [1000 * (self.calls[i + 1][0] - self.calls[i][1]) for i in range(skip, len(self.calls) - 1)]


class CollectorPauses:
    """Python's cycle collector during a run: when each collection ran, how long and which generation
    (gc.callbacks, called on whichever thread collects, which holds the GIL meanwhile)."""

    def __init__(self) -> None:
        self.pauses: list[tuple[float, float, int]] = []  # (start, end, generation), perf_counter seconds
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.append((self._started, time.perf_counter(), int(info["generation"])))

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        ms = [1000 * (end - start) for start, end, _ in self.pauses]
        return {"collections": len(ms), "by_generation": {g: sum(1 for *_, gen in self.pauses if gen == g) for g in range(3)},
                "total_ms": sum(ms), "longest_ms": max(ms, default=0.0)}


def stall_causes(d: Deliveries, stalls: list[dict], push_calls: list[tuple[float, float]],
                 pauses: list[tuple[float, float, int]]) -> list[dict]:
    """For each stall (an interval between two new frames' first deliveries, named by the frame that
    ended it): its ms inside engine.push, and in the cycle collector, by overlap of time spans."""
    first = dict(first_emissions(d))
    ordered = sorted(first)
    causes = []
    for stall in stalls:
        index = bisect.bisect_left(ordered, stall["frame"])
        if index == 0:
            continue
        begin, end = d.times[first[ordered[index - 1]]], d.times[first[stall["frame"]]]
        in_push = sum(max(0.0, min(b, end) - max(a, begin)) for a, b in push_calls)
        in_gc = sum(max(0.0, min(b, end) - max(a, begin)) for a, b, _ in pauses)
        causes.append({**stall, "in_push_ms": round(1000 * in_push, 1), "in_collector_ms": round(1000 * in_gc, 1)})
    return causes


class StandInModel:
    """What run_sequence is handed with --stand-in-ms: a model already prepared (so nothing loads or
    converts it) whose engine the bench replaces by StandInEngine."""

    config = None
    inference_spec = types.SimpleNamespace(compiled=False)


class StandInEngine:
    """Not a model: full-size predictions of a synthetic scene, one per push after the scale frames, at
    `period_s` per frame, the way a pipelined GPU engine paces them.

    The "GPU" finishes frame k at F_k = max(F_{k-1}, submitted_k) + period; push(k) returns frame k-1's
    prediction at F_{k-1}, sleeping until then (as a device synchronisation waits, without the GIL).
    The scene: a bumpy surface facing a camera that slides sideways, so each frame shows a little
    new ground, as a real video does.
    """

    def __init__(self, period_s: float, height: int, width: int, scale_frames: int) -> None:
        from stream_recon.models.stream.prediction import FRAME_KEY, FRAME_SCALE

        self.period_s, self.scale_frames = period_s, scale_frames
        self._types = (FRAME_SCALE, FRAME_KEY)
        rng = np.random.default_rng(0)
        v, u = np.mgrid[0:height, 0:width].astype(np.float32)
        self._depth = (3.0 + 0.2 * np.sin(u / 23.0) * np.cos(v / 17.0)).astype(np.float32)
        self._conf = (1.5 + 3.0 * rng.random((height, width))).astype(np.float32)
        self._image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        focal = 0.9 * width
        self._intrinsics = np.array([[focal, 0, width / 2], [0, focal, height / 2], [0, 0, 1]], np.float32)
        self._done_at = 0.0  # F of the last frame submitted
        self._held: list[tuple[int, float]] = []  # frames submitted, not yet returned
        self.num_frames = 0

    slow_first_step = False  # nothing compiles or records: run_sequence's warm-up has nothing to move

    def warm_up(self, image: Any) -> dict[str, float]:
        return {}

    def push(self, image: Any, timestamp: float | None = None) -> list:
        now = time.perf_counter()
        index, self.num_frames = self.num_frames, self.num_frames + 1
        timestamp = float(index) if timestamp is None else float(timestamp)
        if index < self.scale_frames:
            self._held.append((index, timestamp))
            if index < self.scale_frames - 1:
                return []
            self._wait(now + self.scale_frames * self.period_s)
            held, self._held = self._held, []
            self._done_at = time.perf_counter()
            return [self._prediction(i, t) for i, t in held]
        ready_at = self._done_at
        self._done_at = max(self._done_at, now) + self.period_s
        held, self._held = self._held, [(index, timestamp)]
        self._wait(ready_at)
        return [self._prediction(i, t) for i, t in held]

    def finish(self) -> list:
        self._wait(self._done_at)
        held, self._held = self._held, []
        return [self._prediction(i, t) for i, t in held]

    def stats(self) -> dict:
        return {"frames": self.num_frames, "keyframes": self.num_frames, "cached_frames": 0, "cache_bytes": 0,
                "attention": "stand-in", "cuda_graphs": False}

    def close(self) -> None:
        """Nothing runs beside it."""

    def helpers(self) -> dict:
        """It starts no helper (models/supervision.py's HelperOwner)."""
        return {}

    @staticmethod
    def _wait(until: float) -> None:
        remaining = until - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def _prediction(self, index: int, timestamp: float) -> Any:
        from stream_recon.models.stream.prediction import FramePrediction

        c2w = np.eye(4, dtype=np.float32)[:3].copy()
        c2w[0, 3] = 0.004 * index  # a few pixels of motion per frame at depth 3
        return FramePrediction(  # fresh arrays per frame, as the engine's copy from the pinned buffers
            frame_index=index, timestamp=timestamp, frame_type=self._types[index >= self.scale_frames],
            pose_enc=np.zeros(9, np.float32), c2w=c2w, intrinsics=self._intrinsics.copy(),
            depth=self._depth.copy(), depth_conf=self._conf.copy(), image=self._image.copy(),
        )


class SceneClient:
    """A websocket client on the live viewer, in a thread: it connects as a browser does (its camera
    first, so viser counts it as a client) and receives every scene message, counting bytes. It does not
    decode the messages: a browser does that in its own process."""

    def __init__(self, port: int) -> None:
        self.url = f"ws://127.0.0.1:{port}"
        self.connected_at: float | None = None
        self.bytes_received = 0
        self.messages = 0
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._listen()), name="scene-client", daemon=True)
        self._thread.start()

    async def _listen(self) -> None:
        import msgspec
        import viser
        import websockets

        camera = {"type": "ViewerCameraMessage", "wxyz": [1.0, 0.0, 0.0, 0.0], "position": [0.0, 0.0, -3.0],
                  "fov": 1.2, "near": 0.01, "far": 100.0, "image_height": 480, "image_width": 640,
                  "look_at": [0.0, 0.0, 0.0], "up_direction": [0.0, -1.0, 0.0]}
        while not self._stop.is_set():  # the server starts once the run has its model: retry until then
            try:
                async with websockets.connect(self.url, subprotocols=[f"viser-v{viser.__version__}"],
                                              max_size=None) as socket:
                    self.connected_at = time.perf_counter()
                    await socket.send(msgspec.msgpack.encode(camera))
                    async for raw in socket:
                        self.bytes_received += len(raw)
                        self.messages += 1
                return
            except (OSError, websockets.InvalidHandshake, websockets.InvalidURI):
                await asyncio.sleep(0.02)
            except websockets.ConnectionClosed:
                return
            except Exception as error:  # noqa: BLE001 - reported in the result, not raised in a thread
                self.error = repr(error)
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# --------------------------------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def steady_from(options: Any) -> int:
    """The first steady-state frame: once the window is full, or half way through a shorter run."""
    return min(options.scale_frames + options.window, max(options.scale_frames, (options.max_frames or 0) // 2))


def rollover_regions(d: Deliveries, overlap: int) -> list[tuple[int, int]]:
    """Frame ranges [first, last] whose intervals a chunk rollover's work can lengthen: from `overlap`
    frames before the first frame delivered after it (a spare engine starts the next chunk there) to
    two frames past the run of frames first emitted provisionally (while the spare caught up)."""
    first_provisional = set()
    seen = set()
    for frame, provisional in zip(d.frames, d.provisional, strict=True):
        if frame not in seen and provisional:
            first_provisional.add(frame)
        seen.add(frame)
    regions = []
    for position in range(1, len(d.rollovers)):
        if d.rollovers[position] > d.rollovers[position - 1]:
            at = last = d.frames[position]
            while last + 1 in first_provisional or last in first_provisional:
                last += 1
            regions.append((at - overlap - 1, last + 2))
    return regions


def first_emissions(d: Deliveries) -> list[tuple[int, int]]:
    """(frame, position of its first delivery) for every frame delivered, in frame order."""
    first_seen: dict[int, int] = {}
    for position, frame in enumerate(d.frames):
        first_seen.setdefault(frame, position)
    return sorted(first_seen.items())


def warm_up_stats(d: Deliveries, started: float) -> dict[str, Any]:
    """The start of a run as a user sees it: the longest interval between new frames from the first
    prediction on (compilation, graph recording and rollovers included), and when the 100th frame
    came (from `started`)."""
    new = first_emissions(d)
    times = [d.times[position] for _, position in new]
    intervals = [(1000 * (after - before), frame)
                 for (frame, _), before, after in zip(new[1:], times, times[1:], strict=False)]
    longest = max(intervals, default=(float("nan"), None))
    return {
        "longest_interval_after_first_prediction_ms": longest[0],
        "longest_interval_after_first_prediction_frame": longest[1],
        "prediction_100_s": times[99] - started if len(times) >= 100 else float("nan"),
        "prediction_100_at": times[99] if len(times) >= 100 else float("nan"),
    }


def compiled_steady_fps(d: Deliveries, while_streaming: dict | None, overlap: int) -> float | None:
    """steady_fps from the first frame a run that compiled while it streamed stepped compiled (None for
    other runs, and for one that never switched)."""
    switched = (while_streaming or {}).get("from_frame")
    return None if switched is None else interval_stats(d, switched + 1, overlap)["steady_fps"]


def interval_stats(d: Deliveries, steady_from: int, overlap: int) -> dict[str, Any]:
    """Intervals between first emissions of consecutive new frames, from frame `steady_from` on."""
    times, frames, chunks, rollovers = d.times, d.frames, d.chunks, d.rollovers
    new = first_emissions(d)
    steady = [(frame, pos) for frame, pos in new if frame >= steady_from]
    intervals = []  # (ms, frame it ended with, a rollover happened in it)
    for (_, before), (frame, after) in zip(steady, steady[1:], strict=False):
        rolled = rollovers[after] != rollovers[before] or chunks[after] != chunks[before]
        intervals.append((1000 * (times[after] - times[before]), frame, rolled))
    if not intervals:
        nan = float("nan")
        return {"steady_frames": len(steady), "steady_fps": nan, "p50_ms": nan, "p99_ms": nan, "longest_stall_ms": nan}
    ms = [value for value, _, _ in intervals]
    p50 = percentile(ms, 50)
    longest = max(intervals)
    stalls = [{"ms": round(value, 1), "frame": frame, "rollover": rolled}
              for value, frame, rolled in intervals if value > STALL_FACTOR * p50]
    regions = rollover_regions(d, overlap)
    at_rollovers = [(value, frame) for value, frame, _ in intervals if any(a <= frame <= b for a, b in regions)]
    rollover_longest = max(at_rollovers, default=(float("nan"), None))
    span = times[steady[-1][1]] - times[steady[0][1]]
    return {
        "steady_frames": len(steady),
        "steady_fps": len(intervals) / span if span > 0 else float("nan"),
        "p50_ms": p50,
        "p90_ms": percentile(ms, 90),
        "p99_ms": percentile(ms, 99),
        "mean_ms": float(np.mean(ms)),
        "longest_stall_ms": longest[0],
        "longest_stall_frame": longest[1],
        "longest_stall_at_rollover": longest[2],
        "rollover_regions": regions,
        "rollover_longest_ms": rollover_longest[0],
        "rollover_longest_frame": rollover_longest[1],
        "stalls": stalls[:50],
        "num_stalls": len(stalls),
        # the loop-closure acceptance's bound: no frame interval above twice the median
        "over_2x_median": [{"ms": round(value, 1), "frame": frame, "rollover": rolled}
                           for value, frame, rolled in intervals if value > 2 * p50][:50],
        "re_emissions": len(frames) - len(new),
    }


# ------------------------------------------------------------------------------------------ the runs


def build_model(args: argparse.Namespace) -> tuple[Any, float]:
    """The model as run_sequence receives it: None for a checkpoint (the run loads it, as `stream-recon`
    does), else the synthetic weights as loaded, which the run prepares (its --compile choice included)."""
    if args.checkpoint:
        return None, 0.0
    start = time.perf_counter()
    sys.path.insert(0, str(REPO / "scripts"))
    from bench import build_model as build_synthetic  # scripts/bench.py: the same model, same weights

    model, _ = build_synthetic(args.model)
    return model, time.perf_counter() - start


def engine_model(args: argparse.Namespace, model: Any, options: Any, device: str, compiled: bool) -> Any:
    """The model the engine-only run streams with: prepared as the product run's was (`compiled`)."""
    from stream_recon.app.run.loading import load_model_for, prepared_for_run

    if args.stand_in_ms:
        return model
    if model is None:
        return load_model_for(options, device, compile=compiled)
    return prepared_for_run(model, options, device, compile=compiled)


def run_options(args: argparse.Namespace, port: int) -> Any:
    from stream_recon.app.options import RunOptions

    extra = {}
    for name in ("save_depth", "save_images", "save_predictions", "flow_threshold", "max_gap", "gpu_memory",
                 "mask_sky", "camera_iterations"):
        value = getattr(args, name)
        if value is not None:
            extra[name] = value
    return RunOptions(
        checkpoint=args.checkpoint, device=args.device, dtype=args.dtype, attention=args.attention,
        compile="off" if args.no_compile else args.compile, scale_frames=args.scale, window=args.window, chunk_frames=args.chunk_frames,
        overlap=args.overlap, keyframes=args.keyframes, image_width=args.image_width, max_frames=args.frames,
        kv_cache=args.kv_cache, viewer=args.viewer, port=port, overwrite=True,
        loop_closure=getattr(args, "loop_closure", "auto"), warm_up=getattr(args, "warm_up", "auto"), **extra,
    )


def product_run(args: argparse.Namespace, video: Path, options: Any, model: Any, device: str) -> dict[str, Any]:
    """run_sequence on the video, as `stream-recon VIDEO` runs it, with a recorder and (maybe) a client."""
    from rich.console import Console

    from stream_recon.app.run import pipeline
    from stream_recon.app.sources.preprocess import model_input_size

    engines: list[TimedEngine] = []
    real_build_engine = pipeline.build_engine

    def build_timed_engine(model_: Any, options_: Any, device_: str, dtype: Any, console: Any) -> TimedEngine:
        if args.stand_in_ms:
            height, width = model_input_size(*video_size(video), options_.image_width)
            engine = StandInEngine(args.stand_in_ms / 1000, height, width, options_.scale_frames)
        else:
            engine = real_build_engine(model_, options_, device_, dtype, console, lookahead=LOOKAHEAD[args.lookahead])
        engines.append(TimedEngine(engine))
        return engines[-1]

    viewers: list[Any] = []
    real_start_viewer = pipeline._start_viewer
    clients: list[SceneClient] = []
    client_wait_s = 0.0

    def start_kept_viewer(*args_: Any) -> Any:
        """The run's viewer; with --client, a client connected to it before the first frame is read (the
        wait is taken off the first-prediction latency: a browser would be open already)."""
        nonlocal client_wait_s
        viewers.append(real_start_viewer(*args_))
        if viewers[-1] is not None and args.client:
            waiting_since = time.perf_counter()
            clients.append(SceneClient(viewers[-1].port))
            while not viewers[-1].server.get_clients() and time.perf_counter() - waiting_since < 30:
                if clients[-1].error is not None:
                    raise RuntimeError(f"the websocket client failed: {clients[-1].error}")
                time.sleep(0.01)
            client_wait_s = time.perf_counter() - waiting_since
        return viewers[-1]

    recorder = DeliveryRecorder()
    # The progress line is drawn as on a terminal (its cost is part of the run), into /dev/null.
    console = Console(file=open(os.devnull, "w"), force_terminal=True, width=160)  # noqa: SIM115
    output_dir = Path(args.output) if args.output else Path(tempfile.mkdtemp(prefix="bench_e2e_"))
    pipeline.build_engine, pipeline._start_viewer = build_timed_engine, start_kept_viewer
    try:
        rss_before = rss_bytes()
        started = time.perf_counter()
        with CollectorPauses() as collector:
            summary = pipeline.run_sequence(str(video), output_dir, options, model=model, extra_sinks=[recorder],
                                            console=console)
        ended = time.perf_counter()
    finally:
        pipeline.build_engine, pipeline._start_viewer = real_build_engine, real_start_viewer
        for client in clients:
            client.close()
    d = recorder.deliveries
    if summary.status != "complete":
        raise RuntimeError(f"the run ended {summary.status}: {summary.error}")
    npz = list((output_dir / "predictions").glob("*.npz"))
    npz_bytes = sum(path.stat().st_size for path in npz)
    all_bytes = sum(path.stat().st_size for path in output_dir.rglob("*") if path.is_file())
    run_json = json.loads((output_dir / "run.json").read_text())
    engine_stats = run_json["summary"].get("engine", {})
    timed = engines[0]
    outside = timed.outside_ms(skip=options.scale_frames)
    intervals = interval_stats(d, steady_from(options), options.overlap)
    result = {
        "model_input": "x".join(str(side) for side in reversed(recorder.image_size or ())),
        "compiled": run_json["settings"].get("compile"),
        "inductor_graph_cache": inductor_graph_cache(),
        "compile_beside": run_json["summary"].get("compile_beside"),
        "compiled_while_streaming": run_json["summary"].get("compiled_while_streaming"),
        "frames": summary.frames,
        "keyframes": summary.keyframes,
        "run_s": ended - started,
        # the run's end after the stream's: the writer's last files, the end-of-run loop-closure wait
        "after_last_frame_s": ended - d.times[-1] if d.times else float("nan"),
        "first_prediction_s": d.times[0] - started - client_wait_s if d.times else float("nan"),
        "first_prediction_at": d.times[0] - client_wait_s if d.times else float("nan"),
        **intervals,
        # a run that compiled while it streamed: its steady FPS from the first frame stepped compiled on
        "steady_fps_compiled": compiled_steady_fps(d, run_json["summary"].get("compiled_while_streaming"),
                                                   options.overlap),
        # where the time of each interval over twice the median went
        "over_2x_median_causes": stall_causes(d, intervals.get("over_2x_median", []), timed.calls, collector.pauses),
        "collector": collector.summary(),
        **warm_up_stats(d, started),
        "main_thread_outside_engine_ms_p50": percentile(outside, 50),
        "main_thread_outside_engine_ms_mean": float(np.mean(outside)) if outside else float("nan"),
        "main_thread_outside_engine_ms_p99": percentile(outside, 99),
        "engine_push_ms_p50": percentile([1000 * (b - a) for a, b in timed.calls[options.scale_frames:]], 50),
        "host_rss_gb": max(d.rss, default=rss_bytes()) / 2**30,
        "host_rss_before_run_gb": rss_before / 2**30,
        "peak_host_rss_gb": peak_rss_bytes() / 2**30,
        "bytes_per_frame": npz_bytes / max(1, len(npz)),
        "output_bytes": all_bytes,
        "rollovers": engine_stats.get("rollovers"),
        "rollovers_ahead": engine_stats.get("rollovers_ahead"),
        "provisional_frames": engine_stats.get("provisional_frames"),
        "lookahead_starts": engine_stats.get("lookahead_starts"),
        "warm_up": engine_stats.get("warm_up"),
        "run_model_load_s": run_json["summary"]["timings"].get("model_load_s"),
        "run_warm_up_s": run_json["summary"]["timings"].get("warm_up_s"),
        "run_warm_up_parts_s": run_json["summary"]["timings"].get("warm_up_parts_s"),
        "spare_warm_up_s": engine_stats.get("spare_warm_up_s"),
        "compiled_code": engine_stats.get("compiled_code"),
        "run_json_fps": run_json["summary"].get("fps"),
        "run_json_model_fps": run_json["summary"].get("model_fps"),
        "loop_closure": run_json["summary"].get("loop_closure"),
        "output_dir": str(output_dir),
    }
    if viewers and viewers[0] is not None:
        scene = viewers[0].scene_summary()  # the viewer thread's own time, off the main thread
        result["viewer"] = {**scene, "busy_ms_per_frame": 1000 * scene["busy_seconds"] / max(1, summary.frames)}
    if clients:
        client = clients[0]
        result["client"] = {"wait_for_connection_s": client_wait_s, "bytes": client.bytes_received,
                            "messages": client.messages, "error": client.error}
    if not args.output and not args.keep_output:
        import shutil

        shutil.rmtree(output_dir, ignore_errors=True)
    return result


def inductor_graph_cache() -> dict[str, int] | None:
    """This process's hits and misses of Inductor's graph cache so far (None before any compile)."""
    if "torch._dynamo.utils" not in sys.modules:
        return None
    from torch._dynamo.utils import counters

    return {name: counters["inductor"][name] for name in ("fxgraph_cache_hit", "fxgraph_cache_miss")}


def engine_run(args: argparse.Namespace, video: Path, options: Any, model: Any, device: str, dtype: Any) -> dict:
    """The engine alone on the same frames (decoded and preprocessed first), with the same options:
    `engine.push` in a tight loop, predictions on the host, nothing written."""
    from rich.console import Console

    from stream_recon.app.run.loading import build_engine
    from stream_recon.app.sources.opening import open_source

    with open_source(str(video), options.selection(), image_width=options.image_width) as source:
        frames = [(frame.image, frame.timestamp) for frame in source]
    if args.stand_in_ms:
        height, width = frames[0][0].shape[-2:]
        engine = StandInEngine(args.stand_in_ms / 1000, height, width, options.scale_frames)
    else:
        engine = build_engine(model, options, device, dtype, Console(file=open(os.devnull, "w")),  # noqa: SIM115
                              lookahead=LOOKAHEAD[args.lookahead])
    recorder = DeliveryRecorder()
    started = time.perf_counter()
    for image, timestamp in frames:
        for pred in engine.push(image, timestamp=timestamp):
            recorder.on_frame(pred, engine.stats())
    for pred in engine.finish():
        recorder.on_frame(pred, engine.stats())
    engine.close()
    d = recorder.deliveries
    stats = interval_stats(d, steady_from(options), options.overlap)
    return {"engine_" + key if not key.startswith("engine") else key: value for key, value in stats.items()} | {
        "engine_first_prediction_s": d.times[0] - started if d.times else float("nan"),
        "engine_frames": len(frames),
    }


def sink_costs(video: Path, options: Any, frames: int = 120) -> dict[str, float]:
    """Median ms per frame of each thing done per frame besides the engine, one at a time on one thread, at
    the video's model input size: what each thread's share of one core is at a given frame rate."""
    from stream_recon.app.outputs.atomic_writes import atomic_write
    from stream_recon.app.outputs.npz_schema import prediction_arrays
    from stream_recon.app.outputs.pointcloud import PointAccumulator
    from stream_recon.app.sources.preprocess import model_input_size, preprocess_frame_uint8
    from stream_recon.app.viewer import LiveViewer

    def median_ms(call: Any, items: list) -> float:
        times = []
        for item in items:
            start = time.perf_counter()
            call(item)
            times.append(time.perf_counter() - start)
        return 1000 * float(np.median(times[len(times) // 4:]))  # past the first quarter: warm

    height, width = model_input_size(*video_size(video), options.image_width)
    stand_in = StandInEngine(0.0, height, width, 1)
    preds = [stand_in._prediction(index, float(index)) for index in range(frames)]
    capture, decoded, decode_s = cv2.VideoCapture(str(video)), [], []
    while len(decoded) < min(frames, 60):
        start = time.perf_counter()
        if not capture.grab():
            break
        decoded.append(cv2.cvtColor(capture.retrieve()[1], cv2.COLOR_BGR2RGB))
        decode_s.append(time.perf_counter() - start)
    capture.release()
    accumulator = PointAccumulator()
    outputs = options.prediction_outputs()
    with tempfile.TemporaryDirectory() as folder:
        def write_npz(pred: Any) -> None:
            stored = outputs.stored(prediction_arrays(pred))
            atomic_write(Path(folder) / f"{pred.frame_index:06d}.npz", lambda f: np.savez(f, **stored), binary=True)

        costs = {
            "decode_ms": 1000 * float(np.median(decode_s)),
            "preprocess_ms": median_ms(lambda rgb: preprocess_frame_uint8(rgb, options.image_width), decoded),
            "npz_write_ms": median_ms(write_npz, preds),
            "point_cloud_ms": median_ms(lambda p: accumulator.add_frame(
                p.frame_index, p.depth, p.depth_conf, p.intrinsics, p.c2w, p.image), preds),
        }
    viewer = LiveViewer(port=free_port(), update_hz=1000.0)
    try:
        costs["viewer_on_frame_ms"] = median_ms(lambda p: viewer.on_frame(p, {}), preds)
        viewer.flush(timeout=60)
        costs["viewer_thread_ms"] = 1000 * viewer.scene_summary()["busy_seconds"] / len(preds)
    finally:
        viewer.close("complete")
    return costs


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("video", nargs="?", help="a video file; default: one made from app/sample (--frames long)")
    parser.add_argument("--frames", type=int, default=1000, help="frames to run (and to make)")
    parser.add_argument("--video-size", default="640x468",
                        help="WxH of the made video; 640x468 becomes the engine bench's 518x378 (640x480: 518x392); "
                        "several, comma-separated (1280x720,640x468,640x480,720x1280), run one after another in "
                        "this process, each followed by a row of the shape table")
    parser.add_argument("--model", default="lingbot-map", help="model preset with synthetic weights (tiny: smoke test)")
    parser.add_argument("--checkpoint", help="a real checkpoint instead of synthetic weights")
    parser.add_argument("--stand-in-ms", type=float, default=0.0,
                        help="no model: a stand-in engine that delivers full-size predictions every this many ms")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="the run's --compile")
    parser.add_argument("--no-compile", action="store_true", help="--compile off")
    parser.add_argument("--image-width", type=int, default=518, help="model input width")
    parser.add_argument("--scale", type=int, default=8)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--chunk-frames", type=int, default=320)
    parser.add_argument("--overlap", type=int, default=16)
    parser.add_argument("--keyframes", default="all")
    parser.add_argument("--flow-threshold", type=float, default=None, help="flow keyframes: the threshold in pixels")
    parser.add_argument("--max-gap", type=int, default=None, help="flow keyframes: most frames between keyframes")
    parser.add_argument("--kv-cache", default="auto", help="auto | fp8")
    parser.add_argument("--gpu-memory", default=None,
                        help="a budget such as 8GiB: the run plans for it (--gpu-memory) and the process's allocator is "
                        "capped at it less the CUDA context (torch.cuda.set_per_process_memory_fraction), as on a GPU of "
                        "that size")
    parser.add_argument("--lookahead", choices=sorted(LOOKAHEAD), default="auto",
                        help="the next chunk predicted beside the stream (ChunkedEngine's lookahead)")
    parser.add_argument("--loop-closure", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--warm-up", choices=("auto", "on", "off"), default="auto",
                        help="the run's --warm-up: the streaming step compiled and recorded before the first frame")
    parser.add_argument("--viewer", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--client", action="store_true", help="with --viewer: a websocket client receives the scene")
    parser.add_argument("--port", type=int, default=0, help="viewer port (0: a free one)")
    parser.add_argument("--save-depth", default=None, help="output option: float32 | float16")
    parser.add_argument("--save-images", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--save-predictions", default=None, help="output option: all | keyframes")
    parser.add_argument("--mask-sky", action="store_true", default=None,
                        help="the run's --mask-sky (the sky network in STREAM_RECON_CHECKPOINTS: "
                        "scripts/probes/skyseg_standin.py makes a stand-in)")
    parser.add_argument("--camera-iterations", type=int, default=None, help="the run's --camera-iterations")
    parser.add_argument("--no-engine-run", action="store_true", help="skip the engine-only measurement")
    parser.add_argument("--sink-costs", action="store_true",
                        help="also time each per-frame part alone (decode, preprocess, npz, point cloud, viewer)")
    parser.add_argument("--output", help="run directory (kept); default: a temporary one, removed")
    parser.add_argument("--keep-output", action="store_true")
    parser.add_argument("--video-dir", default=tempfile.gettempdir(), help="where a made video is kept for reuse")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--log", help="write stream-recon's log (INFO and up: memory plan, the spare's room, rollovers, "
                        "warnings) to this file, each line with the CUDA allocator's state; the table shows none")
    parser.add_argument("--timeline", action="store_true",
                        help="sample the main thread and the dry pass ahead until the 100th prediction: what they "
                             "ran, as segments of 0.1 s or more from the process's start, and where the kernel "
                             "builds spent their time (JSON 'timeline')")
    return parser


class AllocatorState(logging.Filter):
    """Prefixes a record with what the CUDA allocator holds when it is logged (once CUDA is in use)."""

    def filter(self, record: logging.LogRecord) -> bool:
        import torch

        if torch.cuda.is_initialized():
            gib = 2**30
            free, _ = torch.cuda.mem_get_info()
            record.msg = (f"[allocated {torch.cuda.memory_allocated() / gib:.2f}, reserved "
                          f"{torch.cuda.memory_reserved() / gib:.2f}, peak {torch.cuda.max_memory_allocated() / gib:.2f}, "
                          f"free {free / gib:.2f} GiB] {record.msg}")
        return True


def log_to_file(path: str) -> None:
    """stream-recon's log into `path`: bench_e2e calls run_sequence without the CLI's log handler."""
    handler = logging.FileHandler(path)
    handler.addFilter(AllocatorState())
    handler.setFormatter(logging.Formatter("%(relativeCreated)d ms %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("stream_recon")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def main() -> None:
    args = argument_parser().parse_args()
    process_started = process_start_time()
    if args.log:
        log_to_file(args.log)
    timeline = ThreadTimeline() if args.timeline else None  # (the first video's run only)

    import torch

    from stream_recon.app.options import resolve_device, resolve_dtype

    torch.backends.cuda.matmul.allow_tf32 = True
    port = args.port or free_port()
    options = run_options(args, port)
    device = resolve_device(options.device)
    if args.gpu_memory and device.startswith("cuda"):
        from stream_recon.models.stream.memory import hold_to_card
        from stream_recon.models.stream.memory_size import parse_memory_size

        hold_to_card(parse_memory_size(args.gpu_memory), device)  # as on a GPU of that size
    dtype = resolve_dtype(options.dtype, device)
    sizes = args.video_size.split(",")
    made = [(Path(args.video), 0.0)] if args.video else [bench_video(args, size) for size in sizes]
    videos = [video for video, _ in made]
    # A user's video exists before the command starts: the seconds this process spent making its
    # videos are left out of the times "from the process's start" (and reported beside them).
    video_made_s = sum(seconds for _, seconds in made)
    process_started += video_made_s
    # the stand-in needs no model; run_sequence only needs to be told not to load one
    model, load_s = (StandInModel(), 0.0) if args.stand_in_ms else build_model(args)
    results = []
    for video in videos:
        result: dict[str, Any] = {
            "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)",
            "torch": torch.__version__,
            "engine": f"stand-in, {args.stand_in_ms:g} ms per frame" if args.stand_in_ms else args.model,
            "video": str(video),
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "video_dir")},
            "model_load_s": load_s,
            "video_made_s": round(video_made_s, 3),
        }
        result.update(measure_video(args, video, options, model, device, dtype, process_started, timeline))
        timeline = None
        print_table(result)
        results.append(result)
    if len(results) > 1:
        print_shape_rows(results)
    if args.json:
        payload = results[0] if len(results) == 1 else {"rows": results}
        Path(args.json).write_text(json.dumps(without_nan(payload), indent=1) + "\n")


def bench_video(args: argparse.Namespace, size: str) -> tuple[Path, float]:
    """The made video of `size` (WxH), made once and kept in --video-dir, and the seconds this call
    spent making it (0 where it was there already)."""
    width, height = (int(side) for side in size.split("x"))
    video = Path(args.video_dir) / f"bench_e2e_{args.frames}_{width}x{height}.mp4"
    if video.exists():
        return video, 0.0
    made_at = time.perf_counter()
    make_video(video, args.frames, width, height)
    seconds = time.perf_counter() - made_at
    print(f"made {video} ({args.frames} frames, {width}x{height}) in {seconds:.1f} s", file=sys.stderr)
    return video, seconds


def measure_video(args: argparse.Namespace, video: Path, options: Any, model: Any, device: str, dtype: Any,
                  process_started: float, timeline: ThreadTimeline | None = None) -> dict[str, Any]:
    """The product run on one video (the first of a process pays for compiling its input size: the whole
    run's FPS says so), then the engine alone on the same frames."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    result = product_run(args, video, options, model, device)
    if timeline is not None:  # until the 100th prediction, times from the process's start
        timeline.stop()
        origin = time.perf_counter() - (time.time() - process_started)
        result["timeline"] = timeline.summary(origin, result["prediction_100_at"])
    result["first_prediction_from_process_start_s"] = time.time() - (time.perf_counter() - result.pop(
        "first_prediction_at")) - process_started
    result["prediction_100_from_process_start_s"] = time.time() - (time.perf_counter() - result.pop(
        "prediction_100_at")) - process_started
    if device.startswith("cuda"):
        result["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        # What the allocator held at its peak (a card must have this much, plus the CUDA context).
        result["peak_gpu_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    if not args.no_engine_run:
        import gc

        gc.collect()  # the product run's engine and its cache, before the engine run makes its own
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        compiled = bool(result["compiled"])
        result.update(engine_run(args, video, options, engine_model(args, model, options, device, compiled),
                                 device, dtype))
        result["engine_fps"] = result.get("engine_steady_fps", float("nan"))
        result["product_over_engine"] = result.get("steady_fps", float("nan")) / result["engine_fps"]
    if args.sink_costs:
        result["sink_costs_ms"] = sink_costs(video, options)
    return result


def print_shape_rows(results: list[dict[str, Any]]) -> None:
    """One line per video: the rows of the shape table (README, docs/PERFORMANCE.md)."""
    print("\nvideo -> model input | steady FPS | p50 / p99 ms | whole-run FPS (run.json) | engine FPS | peak GPU GiB "
          "(reserved)")
    for r in results:
        size = Path(r["video"]).stem.rsplit("_", 1)[-1]
        print(f"{size} -> {r['model_input']} | {r.get('steady_fps', float('nan')):.1f} | "
              f"{r.get('p50_ms', float('nan')):.1f} / {r.get('p99_ms', float('nan')):.1f} | "
              f"{r.get('run_json_fps') or float('nan'):.1f} | {r.get('engine_fps', float('nan')):.1f} | "
              f"{r.get('peak_gpu_gib', float('nan')):.1f} ({r.get('peak_gpu_reserved_gib', float('nan')):.1f})")


def without_nan(value: Any) -> Any:
    """JSON has no NaN: a measurement that could not be made is null."""
    if isinstance(value, dict):
        return {key: without_nan(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_nan(item) for item in value]
    if isinstance(value, (float, np.floating)):
        return float(value) if np.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def video_size(path: Path) -> tuple[int, int]:
    capture = cv2.VideoCapture(str(path))
    try:
        return int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
    finally:
        capture.release()


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def collector_line(collector: dict[str, Any]) -> str:
    if not collector:
        return "not recorded"
    by_generation = "/".join(str(collector["by_generation"].get(g, 0)) for g in range(3))
    return f"{collector['collections']} ({by_generation}), {collector['total_ms']:.1f} / {collector['longest_ms']:.1f}"


def print_table(result: dict[str, Any]) -> None:
    rows = [
        ("device", result["device"]), ("engine", result["engine"]), ("model input", result["model_input"]),
        ("frames (keyframes)", f"{result['frames']} ({result['keyframes']})"),
        ("steady FPS: product / engine", f"{result.get('steady_fps', float('nan')):.2f} / "
                                         f"{result.get('engine_fps', float('nan')):.2f}"),
        ("interval p50 / p99 ms: product", f"{result.get('p50_ms', float('nan')):.2f} / {result.get('p99_ms', float('nan')):.2f}"),
        ("interval p50 / p99 ms: engine", f"{result.get('engine_p50_ms', float('nan')):.2f} / "
                                          f"{result.get('engine_p99_ms', float('nan')):.2f}"),
        ("longest stall ms (frame, rollover)", f"{result.get('longest_stall_ms', float('nan')):.1f} "
         f"({result.get('longest_stall_frame')}, {result.get('longest_stall_at_rollover')})"),
        ("longest interval at a rollover ms (frame): product", f"{result.get('rollover_longest_ms', float('nan')):.1f} "
         f"({result.get('rollover_longest_frame')})"),
        ("longest interval at a rollover ms (frame): engine", f"{result.get('engine_rollover_longest_ms', float('nan')):.1f} "
         f"({result.get('engine_rollover_longest_frame')})"),
        ("stalls > 3x median", result.get("num_stalls")),
        ("cycle collections (gen 0/1/2), total / longest ms", collector_line(result.get("collector") or {})),
        ("intervals > 2x median: ms (in push / in collector) frame",
         ", ".join(f"{c['ms']:.0f} ({c['in_push_ms']:.0f}/{c['in_collector_ms']:.0f}) f{c['frame']}"
                   for c in result.get("over_2x_median_causes", [])[:8]) or "none"),
        ("rollovers (beside, spare starts before) / provisional frames",
         f"{result.get('rollovers')} ({result.get('rollovers_ahead')}, {result.get('lookahead_starts')}) / "
         f"{result.get('provisional_frames')}"),
        ("main thread outside engine ms p50 / mean", f"{result['main_thread_outside_engine_ms_p50']:.2f} / "
                                                     f"{result['main_thread_outside_engine_ms_mean']:.2f}"),
        ("first prediction s: run / process", f"{result['first_prediction_s']:.2f} / "
                                              f"{result['first_prediction_from_process_start_s']:.2f}"),
        ("100th prediction s: run / process", f"{result['prediction_100_s']:.2f} / "
                                              f"{result['prediction_100_from_process_start_s']:.2f}"),
        ("longest interval after the first prediction ms (frame)",
         f"{result['longest_interval_after_first_prediction_ms']:.1f} "
         f"({result['longest_interval_after_first_prediction_frame']})"),
        ("whole run FPS (run.json)", f"{result.get('run_json_fps') or float('nan'):.2f}"),
        ("model load s (before the run / in it)", f"{result['model_load_s']:.1f} / {result.get('run_model_load_s')}"),
        ("compiled (a compile beside the run)", f"{result.get('compiled')} ({result.get('compile_beside')})"),
        ("Inductor's graph cache: hits / misses", "{fxgraph_cache_hit} / {fxgraph_cache_miss}".format(
            **result["inductor_graph_cache"]) if result.get("inductor_graph_cache") else "-"),
        ("warm-up before the stream s (parts)", f"{result.get('run_warm_up_s')} ({result.get('run_warm_up_parts_s')})"),
        ("first streaming step s: eager step / graph recording / spare's warm-up",
         "{} / {} / {}".format(*[(result.get("warm_up") or {}).get(key) for key in
                                 ("first_streaming_step_s", "graph_record_s")], result.get("spare_warm_up_s"))),
        ("compiled calls: loaded / compiled (s)", "{loaded} / {compiled} ({seconds:.1f})".format(**result["compiled_code"])
         if result.get("compiled_code") else "-"),
        ("host RSS GB (peak)", f"{result['host_rss_gb']:.2f} ({result['peak_host_rss_gb']:.2f})"),
        ("bytes per frame", f"{result['bytes_per_frame']:,.0f}"),
    ]
    for name, value in result.get("sink_costs_ms", {}).items():
        rows.append((f"alone, ms per frame: {name.removesuffix('_ms')}", f"{value:.3f}"))
    if "viewer" in result:
        rows.append(("viewer thread busy ms per frame", f"{result['viewer']['busy_ms_per_frame']:.2f}"))
    if "client" in result:
        rows.append(("viewer client: bytes, messages", f"{result['client']['bytes']:,}, {result['client']['messages']}"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:>{width}}  {value}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
