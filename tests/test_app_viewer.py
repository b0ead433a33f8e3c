"""The live viewer and the replay command, checked through real servers on 127.0.0.1.

A websocket client that speaks viser's wire protocol (below, `SceneMirror`) keeps its own copy of the
scene, as a browser would; a headless Chromium renders the page and a screenshot is checked for points.
The synthetic stream is a camera orbiting a textured plane (world z = PLANE_Z), so every point the viewer
sends can be checked against the plane after applying its parent node's pose.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import msgspec
import numpy as np
import pytest
import viser
import websockets
import websockets.sync.client
import zstandard
from browser_shots import chromium, green_pixels_in_the_centre, shoot_until
from media_helpers import free_port
from typer import Typer
from typer.testing import CliRunner

from stream_recon.app.commands.view import view
from stream_recon.app.outputs.npz_schema import prediction_arrays
from stream_recon.app.outputs.pointcloud import read_ply, write_ply
from stream_recon.app.outputs.rundir import RunDirError
from stream_recon.app.viewer import LiveViewer, allocate_point_budget, sample_keyframe_points
from stream_recon.app.viewer.geometry import splat_arrays
from stream_recon.app.viewer.replay import index_run, recorded_loops, start_replay
from stream_recon.models.loops.corrections import ChunkCorrections, LoopRecord
from stream_recon.models.stream.pose import quat_xyzw_to_rotation
from stream_recon.models.stream.prediction import FRAME_KEY, FRAME_NON_KEY, FRAME_SCALE, FramePrediction
from stream_recon.models.stream.similarity import Sim3

PLANE_Z = 3.0
ARTIFACTS = Path(__file__).parent / "artifacts"


# ----------------------------------------------------------------------------------- synthetic stream


def look_at_c2w(centre: np.ndarray, target: np.ndarray) -> np.ndarray:
    """c2w [3, 4] of an OpenCV camera at `centre` looking at `target`, with world -y as up."""
    forward = (target - centre) / np.linalg.norm(target - centre)
    right = np.cross(forward, np.array([0.0, -1.0, 0.0]))
    right /= np.linalg.norm(right)
    down = np.cross(forward, right)
    return np.concatenate([np.stack([right, down, forward], axis=1), centre[:, None]], axis=1)


def orbit_frame(index: int, *, size=(42, 56), frame_type: int | None = None, angle: float | None = None):
    """Frame `index` of a camera orbiting the plane's centre; depth is the exact ray-plane distance."""
    h, w = size
    angle = 0.05 * index if angle is None else angle
    target = np.array([0.0, 0.0, PLANE_Z])
    centre = target + 3.0 * np.array([math.sin(angle), -0.2, -math.cos(angle)])
    c2w = look_at_c2w(centre, target)
    intrinsics = np.array([[0.9 * w, 0, w / 2], [0, 0.9 * w, h / 2], [0, 0, 1.0]])
    v, u = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    rays_camera = np.stack(
        [(u - w / 2) / intrinsics[0, 0], (v - h / 2) / intrinsics[1, 1], np.ones((h, w))], -1
    )
    rays_world = rays_camera @ c2w[:, :3].T  # [H, W, 3], camera z-component 1
    depth = (PLANE_Z - centre[2]) / rays_world[..., 2]  # z-depth, since the camera-frame ray has z = 1
    hit = centre + depth[..., None] * rays_world
    checker = ((np.floor(hit[..., 0] * 4) + np.floor(hit[..., 1] * 4)) % 2).astype(bool)
    image = np.where(checker[..., None], np.array([230, 40, 40]), np.array([40, 200, 60])).astype(np.uint8)
    if frame_type is None:
        frame_type = FRAME_SCALE if index < 4 else (FRAME_KEY if index % 2 == 0 else FRAME_NON_KEY)
    return FramePrediction(
        frame_index=index,
        timestamp=index / 30,
        frame_type=frame_type,
        pose_enc=np.zeros(9, np.float32),
        c2w=c2w.astype(np.float32),
        intrinsics=intrinsics.astype(np.float32),
        depth=depth.astype(np.float32),
        depth_conf=(1.0 + np.random.default_rng(index).random((h, w))).astype(np.float32),
        image=image,
    )


# -------------------------------------------------------------------------- viser protocol client


class SceneMirror:
    """A websocket client that applies viser's scene messages to its own copy of the scene.

    Server frames: [u64 msgpack size][u64 zstd size][zstd(msgpack)][binary buffers, 8-byte aligned]; the
    msgpack holds {"messages": [...], "binaryBufferLengths": [...]} and arrays appear in messages as
    {"__binary_index": i, "dtype": ...} placeholders (viser/infra/_infra.py, `_message_producer`).
    """

    def __init__(self, url: str) -> None:
        self.url = url.replace("http://", "ws://")
        self.nodes: dict[str, dict] = {}
        self.creates: dict[str, int] = {}  # name -> how many create messages arrived
        self.gui: dict[str, dict] = {}  # uuid -> message
        self.replay_done = False
        self.error: Exception | None = None
        self.error_trace = ""
        self.camera_look_at: tuple | None = None
        self.num_messages = 0
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._socket = None
        self._thread = threading.Thread(
            target=self._loop.run_until_complete, args=(self._listen(),), daemon=True
        )
        self._thread.start()

    async def _listen(self) -> None:
        subprotocol = f"viser-v{viser.__version__}"
        async with websockets.connect(self.url, subprotocols=[subprotocol], max_size=None) as socket_:
            self._socket = socket_
            # A browser reports its camera first; viser counts a client as connected from then on.
            await socket_.send(_camera_message(position=(0.0, 0.0, -3.0)))
            with contextlib.suppress(websockets.ConnectionClosed):
                async for raw in socket_:
                    try:
                        self._apply_frame(raw)
                    except Exception as error:  # surfaced by wait_for, instead of a silent timeout
                        self.error = error
                        self.error_trace = traceback.format_exc()
                        raise

    def _apply_frame(self, raw: bytes) -> None:
        size, compressed = int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:16], "little")
        payload = msgspec.msgpack.decode(
            zstandard.ZstdDecompressor().decompress(raw[16 : 16 + compressed], max_output_size=size)
        )
        buffers, offset = [], 16 + compressed
        for length in payload["binaryBufferLengths"]:
            offset += (8 - offset % 8) % 8
            buffers.append(raw[offset : offset + length])
            offset += length
        with self._lock:
            for message in payload["messages"]:
                self._apply(_resolve_arrays(message, buffers))
                self.num_messages += 1

    def _apply(self, message: dict) -> None:
        kind, name = message["type"], message.get("name")
        if kind == "ReplayDoneMessage":
            self.replay_done = True
        elif kind.startswith("Gui") and "props" in message:
            self.gui[message["uuid"]] = message
        elif kind == "GuiUpdateMessage" and message["uuid"] in self.gui:
            self.gui[message["uuid"]]["props"].update(message["updates"])
        elif kind == "SetCameraLookAtMessage" and not message.get("initial"):  # initial: new browsers only
            self.camera_look_at = tuple(message["look_at"])
        elif kind == "RemoveSceneNodeMessage":
            self.nodes.pop(name, None)
        elif "props" in message and name is not None:
            self.nodes[name] = {"type": kind, "props": message["props"], "position": (0.0, 0.0, 0.0),
                                "wxyz": (1.0, 0.0, 0.0, 0.0), "visible": True}  # fmt: skip
            self.creates[name] = self.creates.get(name, 0) + 1
        elif kind == "SetPositionMessage" and name in self.nodes:
            self.nodes[name]["position"] = tuple(message["position"])
        elif kind == "SetOrientationMessage" and name in self.nodes:
            self.nodes[name]["wxyz"] = tuple(message["wxyz"])
        elif kind == "SetSceneNodeVisibilityMessage" and name in self.nodes:
            self.nodes[name]["visible"] = message["visible"]
        elif kind == "SceneNodeUpdateMessage" and name in self.nodes:
            self.nodes[name]["props"].update(message["updates"])

    def wait_for(self, predicate, timeout: float = 30.0) -> None:  # a hang guard: returns when it holds
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.error is not None:
                raise AssertionError(f"the websocket client failed:\n{self.error_trace}") from self.error
            with self._lock:
                if predicate(self):
                    return
            time.sleep(0.02)
        with self._lock:
            names = sorted(self.nodes)
        raise AssertionError(
            f"scene never reached the expected state; nodes: {names[:20]} ...; camera look-at {self.camera_look_at}"
        )

    def set_gui(self, label: str, value) -> None:
        """Press a button or set an input as a browser does: a GuiUpdateMessage from client to server."""
        uuid = next(u for u, m in self.gui.items() if m["props"].get("label") == label)
        message = msgspec.msgpack.encode(
            {"type": "GuiUpdateMessage", "uuid": uuid, "updates": {"value": value}}
        )
        asyncio.run_coroutine_threadsafe(self._socket.send(message), self._loop).result(timeout=5)

    def report_camera(self, position: tuple[float, float, float]) -> None:
        """Orbit the camera as a user does: the browser reports its new pose (looking at the origin)."""
        message = _camera_message(position)
        asyncio.run_coroutine_threadsafe(self._socket.send(message), self._loop).result(timeout=5)

    def world_points(self, keyframe: str) -> np.ndarray:
        """[N, 3] points of `keyframe`'s cloud mapped to the world through the poses of its ancestors."""
        points = np.asarray(self.nodes[f"{keyframe}/points"]["props"]["points"], dtype=np.float64).reshape(-1, 3)
        parts = keyframe.split("/")
        for depth in range(len(parts), 1, -1):  # the keyframe's parent node first, then its chunk's, ...
            node = self.nodes.get("/".join(parts[:depth]))
            if node is not None:
                rotation = quat_xyzw_to_rotation(np.roll(np.asarray(node["wxyz"], np.float64), -1))
                points = points @ rotation.T + np.asarray(node["position"])
        return points

    def close(self) -> None:
        if self._socket is not None and self._thread.is_alive():
            # The listener's loop ends with the connection, so the close future itself never resolves.
            asyncio.run_coroutine_threadsafe(self._socket.close(), self._loop)
        self._thread.join(timeout=10)


def _camera_message(position: tuple[float, float, float]) -> bytes:
    camera = {"type": "ViewerCameraMessage", "wxyz": [1.0, 0.0, 0.0, 0.0], "position": list(position),
              "fov": 1.2, "near": 0.01, "far": 100.0, "image_height": 480, "image_width": 640,
              "look_at": [0.0, 0.0, 0.0], "up_direction": [0.0, -1.0, 0.0]}  # fmt: skip
    return msgspec.msgpack.encode(camera)


def _resolve_arrays(value, buffers):
    if isinstance(value, dict):
        if "__binary_index" in value and "dtype" in value:
            return np.frombuffer(buffers[value["__binary_index"]], dtype=np.dtype(value["dtype"]))
        return {k: _resolve_arrays(v, buffers) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_arrays(v, buffers) for v in value]
    return value


def keyframe_names(mirror: SceneMirror) -> list[str]:
    """The keyframes' parent nodes (/chunks/C/fNNNNNN), in name order."""
    return sorted(n for n in mirror.nodes if n.startswith("/chunks/") and n.count("/") == 3
                  and n.rsplit("/", 1)[1].startswith("f"))


@pytest.fixture
def viewer():
    live = LiveViewer(port=free_port(), max_points_per_keyframe=600, update_hz=20.0)
    yield live
    live.close("complete")


# ----------------------------------------------------------------------------------------- tests


def loaded(replay, timeout: float = 60.0) -> bool:
    """Whether the keyframes of the replay's last seek were loaded and drawn within `timeout` s."""
    return replay._loader_idle.wait(timeout) and replay.viewer.flush(timeout)


def test_scene_arrives_and_updates_over_websocket(viewer):
    for index in range(8):
        viewer.on_frame(orbit_frame(index), {"frames": index + 1, "cached_frames": index + 1})
    first = SceneMirror(viewer.url)  # joins mid-stream
    for index in range(8, 14):  # the run loop's stats: end-to-end FPS unknown so far (None)
        viewer.on_frame(orbit_frame(index), {"frames": index + 1, "fps": None, "model_fps": 12.5})
    keyframes = [i for i in range(14) if orbit_frame(i).is_keyframe]  # 0-3 scale frames, then even ones
    expected = [f"/chunks/0/f{i:06d}" for i in keyframes]
    try:
        first.wait_for(
            lambda m: keyframe_names(m) == expected and "/trajectory" in m.nodes and "/current" in m.nodes
        )
        first.wait_for(lambda m: len(m.nodes["/trajectory"]["props"]["points"]) == 13 * 2 * 3)
        first.wait_for(
            lambda m: np.allclose(m.nodes["/current"]["position"], orbit_frame(13).c2w[:, 3], atol=1e-4)
        )
        first.wait_for(
            lambda m: any("(model 12.5)" in str(g["props"].get("_markdown")) for g in m.gui.values())
        )
        for name in expected:
            assert first.nodes[f"{name}/frustum"]["type"] == "CameraFrustumMessage"
            assert first.nodes[f"{name}/frustum"]["props"]["_image_data"]  # the thumbnail
            cloud = first.nodes[f"{name}/points"]["props"]
            assert cloud["points"].dtype == np.float16 and 400 < len(cloud["points"]) // 3 <= 600
            # Every point, through its parent's pose, lies on the plane the synthetic depth came from.
            np.testing.assert_allclose(first.world_points(name)[:, 2], PLANE_Z, atol=0.02)
            assert len(np.unique(np.asarray(cloud["colors"]).reshape(-1, 3), axis=0)) == 2  # checkerboard

        # A re-emitted keyframe with a corrected pose moves its parent node and re-sends no points.
        moved = orbit_frame(6)
        moved.c2w = moved.c2w.copy()
        moved.c2w[:, 3] += np.array([0.5, 0.0, 0.0], np.float32)
        viewer.on_frame(moved, {})
        first.wait_for(
            lambda m: np.allclose(m.nodes["/chunks/0/f000006"]["position"], moved.c2w[:, 3], atol=1e-4)
        )
        assert first.creates["/chunks/0/f000006/points"] == 1
        first.wait_for(
            lambda m: np.isclose(m.nodes["/trajectory"]["props"]["points"], moved.c2w[0, 3], atol=1e-4).any()
        )
        # A re-emission with new depth re-sends that keyframe's points.
        deeper = orbit_frame(8)
        deeper.depth = deeper.depth * 1.1
        viewer.on_frame(deeper, {})
        first.wait_for(lambda m: m.creates.get("/chunks/0/f000008/points", 0) >= 2)

        # A browser that joins late gets the whole current scene from viser's buffer.
        viewer.flush()
        late = SceneMirror(viewer.url)
        try:
            late.wait_for(lambda m: m.replay_done)
            assert keyframe_names(late) == expected
            for name in expected:
                assert late.nodes[name]["position"] == first.nodes[name]["position"]
                np.testing.assert_array_equal(late.nodes[f"{name}/points"]["props"]["points"],
                                              first.nodes[f"{name}/points"]["props"]["points"])  # fmt: skip
        finally:
            late.close()
    finally:
        first.close()


def test_binds_loopback_and_moves_to_the_next_free_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        live = LiveViewer(port=port)
        try:
            assert live.server.get_host() == "127.0.0.1"
            assert live.port != port and live.url == f"http://127.0.0.1:{live.port}"
            with socket.create_connection(("127.0.0.1", live.port), timeout=2):
                pass
        finally:
            live.close()
    unset = LiveViewer(host=None, port=None)  # options left unset must not mean "every interface"
    try:
        assert unset.server.get_host() == "127.0.0.1" and unset.port >= 8080
    finally:
        unset.close()


def test_pause_and_follow_from_the_browser(viewer):
    mirror = SceneMirror(viewer.url)
    try:
        mirror.wait_for(lambda m: m.replay_done)
        assert viewer.wait_if_paused(timeout=0.01)
        mirror.set_gui("Pause inference", True)
        deadline = time.monotonic() + 30  # only a hang guard: the loop ends when the click arrives
        while not viewer.paused and time.monotonic() < deadline:
            time.sleep(0.01)
        assert viewer.paused and not viewer.wait_if_paused(timeout=0.05)
        mirror.wait_for(lambda m: any(g["props"].get("label") == "Resume inference" for g in m.gui.values()))

        # "Follow current camera" moves the browser's camera to look along the newest frame.
        mirror.set_gui("Follow current camera", True)
        deadline = time.monotonic() + 30
        while not viewer.settings.follow and time.monotonic() < deadline:  # the click has reached the server
            time.sleep(0.01)
        pred = orbit_frame(3)
        viewer.on_frame(pred, {})

        def looks_along_the_frame(m: SceneMirror) -> bool:
            if m.camera_look_at is None:
                return False
            offset = np.asarray(m.camera_look_at) - pred.c2w[:, 3]  # the median depth ahead, about 3
            return 2.5 < np.linalg.norm(offset) < 3.5 and offset @ pred.c2w[:, 2] > 0.99 * np.linalg.norm(
                offset
            )

        mirror.wait_for(looks_along_the_frame)

        viewer.close("interrupted")  # closing never leaves the run loop stuck in a pause
        assert viewer.wait_if_paused(timeout=0.01)
    finally:
        mirror.close()


def test_point_and_keyframe_controls_from_the_browser(viewer):
    for index in range(6):
        viewer.on_frame(orbit_frame(index, frame_type=FRAME_KEY), {})
    mirror = SceneMirror(viewer.url)
    try:
        names = [f"/chunks/0/f{i:06d}" for i in range(6)]
        mirror.wait_for(lambda m: keyframe_names(m) == names)

        def cloud_sizes(m: SceneMirror) -> list[int]:  # -1: a cloud not (yet) in the scene
            return [len(m.nodes[f"{name}/points"]["props"]["points"]) // 3 if f"{name}/points" in m.nodes else -1
                    for name in names]

        # 600 per keyframe, none hidden: a minimum confidence of 1 keeps every point, as --conf-threshold 1
        mirror.wait_for(lambda m: cloud_sizes(m) == [600] * 6)
        mirror.set_gui("Points / keyframe", 500)
        mirror.wait_for(lambda m: cloud_sizes(m) == [500] * 6)
        # "Drop low conf. %" was a percentile, unlike --conf-threshold: now the same rule as the flag's
        mirror.set_gui("Min. confidence", 1.5)
        confident = [int((sample_keyframe_points(orbit_frame(i, frame_type=FRAME_KEY), 600).confidence[:500] >= 1.5)
                         .sum()) for i in range(6)]
        assert all(100 < count < 400 for count in confident)
        mirror.wait_for(lambda m: cloud_sizes(m) == confident)
        mirror.set_gui("Point size x", 2.0)
        size = mirror.nodes[f"{names[0]}/points"]["props"]["point_size"]
        mirror.wait_for(lambda m: m.nodes[f"{names[0]}/points"]["props"]["point_size"] > 1.9 * size)

        mirror.set_gui("Last N", 2)
        mirror.set_gui("Show all", False)
        mirror.wait_for(lambda m: [m.nodes[name]["visible"] for name in names] == [False] * 4 + [True] * 2)
        mirror.set_gui("Show all", True)
        mirror.wait_for(lambda m: all(m.nodes[name]["visible"] for name in names))

        # The first keyframe already put the camera at the reset view (the viewer thread may do that after
        # this client connected); the user orbits away first, or "Reset view" would rightly send nothing.
        orbited = (5.0, -1.0, -4.0)
        mirror.report_camera(orbited)
        deadline = time.monotonic() + 30
        while not any(np.allclose(c.camera.position, orbited) for c in viewer.server.get_clients().values()):
            assert time.monotonic() < deadline, "the server never saw the orbited camera"
            time.sleep(0.01)
        start = (0.0, 0.0, viewer.scene.scene_scale)  # the reset view looks at the start of the reconstruction
        mirror.set_gui("Reset view", True)
        mirror.wait_for(lambda m: m.camera_look_at is not None and np.allclose(m.camera_look_at, start))
    finally:
        mirror.close()


def test_caps_thin_then_remove_the_oldest_keyframes():
    live = LiveViewer(
        port=free_port(), max_points_per_keyframe=200, max_total_points=1500, max_keyframes=12, update_hz=20.0
    )
    watcher = SceneMirror(live.url)
    try:
        for start in range(0, 40, 5):  # in batches, so that keyframes are thinned and removed over time
            for index in range(start, start + 5):
                live.on_frame(orbit_frame(index, frame_type=FRAME_KEY), {})
            assert live.flush()
        summary = live.scene_summary()
        assert summary["points"] <= 1500 and summary["keyframes"] <= 12
        shown = sorted(live.shown_keyframes())
        assert shown[-1] == 39 and shown == list(range(shown[0], 40))  # the newest ones survive
        assert summary["trajectory_frames"] == 40  # removed keyframes keep their place in the trajectory

        # What the browser holds: the newest cloud whole, the oldest thinned to a quarter, nothing older
        # than the cap.
        expected = [f"/chunks/0/f{i:06d}" for i in shown]
        watcher.wait_for(lambda m: keyframe_names(m) == expected)
        sizes = [len(watcher.nodes[f"{name}/points"]["props"]["points"]) // 3 for name in expected]
        assert sizes[-1] == 200 and sizes[0] == 50 and sum(sizes) <= 1500

        # A late browser gets the current scene, not the history of thinned and removed keyframes.
        late = SceneMirror(live.url)
        try:
            late.wait_for(lambda m: m.replay_done)
            assert keyframe_names(late) == expected
            assert late.num_messages < 8 * len(late.nodes) + 60  # a few per node, plus the GUI
        finally:
            late.close()
    finally:
        watcher.close()
        live.close()


def test_allocate_point_budget_examples():
    assert allocate_point_budget([8, 8, 8, 8], 32) == [8, 8, 8, 8]
    assert allocate_point_budget([8, 8, 8, 8], 20) == [2, 2, 8, 8]
    assert allocate_point_budget([8, 8, 8, 8], 12) == [0, 2, 2, 8]
    assert allocate_point_budget([8, 8, 8, 8], 7) == [0, 0, 0, 8]
    assert allocate_point_budget([], 5) == []


def test_allocate_point_budget_properties():
    rng = np.random.default_rng(0)
    for _ in range(300):
        full = [int(c) for c in rng.integers(1, 400, size=rng.integers(1, 30))]
        cap = int(rng.integers(max(full), 4000))
        counts = allocate_point_budget(full, cap)
        assert sum(counts) <= cap
        assert all(c in (f, max(1, f // 4), 0) for c, f in zip(counts, full, strict=True))
        removed = [c == 0 for c in counts]
        assert removed == sorted(removed, reverse=True)  # only the oldest are removed
        assert counts[-1] == full[-1]  # the newest keyframe is always whole (cap >= its size)
        if any(removed):  # removal starts only once every older keyframe is thinned
            assert all(c == max(1, f // 4) for c, f in zip(counts[:-1], full[:-1], strict=True) if c)


def test_keyframe_sample_is_a_stable_uniform_prefix():
    pred = orbit_frame(5)
    sample = sample_keyframe_points(pred, 300)
    again = sample_keyframe_points(pred, 300)
    np.testing.assert_array_equal(sample.points, again.points)
    assert sample.points.dtype == np.float16 and sample.num_points == 300
    np.testing.assert_allclose(sample.points[:, 2].astype(np.float32), sample.points[:, 2], rtol=1e-3)


def test_on_frame_never_waits_for_the_viewer_thread_or_the_browser():
    big = orbit_frame(0, size=(378, 518), frame_type=FRAME_KEY)  # full model-input size
    live = LiveViewer(port=free_port(), update_hz=2.0, max_pending=64)
    # A browser that connects and then never reads: the server's sends back up, not the caller's.
    stalled = websockets.sync.client.connect(
        live.url.replace("http", "ws"), subprotocols=[f"viser-v{viser.__version__}"]
    )
    # The viewer thread is held inside its first scene update for as long as the test likes.
    drawing, release = threading.Event(), threading.Event()
    apply_prediction = live.scene.keyframes.apply_prediction

    def held_apply_prediction(pred, **options):
        drawing.set()
        release.wait()
        apply_prediction(pred, **options)

    live.scene.keyframes.apply_prediction = held_apply_prediction

    def push_frames(first: int, count: int) -> None:
        for index in range(first, first + count):
            live.on_frame(FramePrediction(**{**big.__dict__, "frame_index": index}), {"frames": index})

    try:
        push_frames(0, 1)
        assert drawing.wait(timeout=30), "the viewer thread never started drawing"
        # If on_frame waited for the viewer thread or the browser, these calls could not all return
        # while it is held: the caller would hang here instead.
        caller = threading.Thread(target=push_frames, args=(1, 2000), daemon=True)
        caller.start()
        caller.join(timeout=60)
        assert not caller.is_alive(), "on_frame blocked while the viewer thread was busy"
        assert not release.is_set() and live.scene_summary()["updates"] == 0  # still held throughout
        assert live.num_pending <= 64 + 2000  # frames beyond max_pending are kept as poses only
        assert live.state._latest.read(lambda pending: len(pending.predictions)) <= 64
    finally:
        release.set()
        stalled.close()
        live.close()


def test_tiny_model_stream_reaches_the_browser(viewer, tiny_model):
    """End to end: the tiny model through the streaming engine into the viewer and a websocket client."""
    import torch

    from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference

    engine = StreamingEngine(prepare_for_inference(tiny_model), StreamConfig(scale_frames=4, keyframes="interval:2"))
    mirror = SceneMirror(viewer.url)
    emitted = []
    try:
        for index in range(8):
            viewer.wait_if_paused()
            image = torch.from_numpy(orbit_frame(index, size=(56, 70)).image).permute(2, 0, 1).float() / 255
            for pred in engine.push(image, timestamp=index / 30):
                viewer.on_frame(pred, engine.stats())
                emitted.append(pred)
        assert [p.frame_index for p in emitted] == list(range(8))
        keyframes = [f"/chunks/0/f{p.frame_index:06d}" for p in emitted if p.is_keyframe]
        assert 4 < len(keyframes) < 8  # scale frames plus every other streaming frame
        mirror.wait_for(lambda m: keyframe_names(m) == keyframes and "/trajectory" in m.nodes)
        mirror.wait_for(lambda m: len(m.nodes["/trajectory"]["props"]["points"]) == 7 * 2 * 3)
        last = emitted[-1]
        mirror.wait_for(lambda m: np.allclose(m.nodes["/current"]["position"], last.c2w[:, 3], atol=1e-4))
        for name, pred in zip(keyframes, [p for p in emitted if p.is_keyframe], strict=True):
            np.testing.assert_allclose(mirror.nodes[name]["position"], pred.c2w[:, 3], atol=1e-5)
            assert len(mirror.nodes[f"{name}/points"]["props"]["points"]) > 0
        # The readout shows the frames attention reads in full, as the engine counts them (markdown
        # travels as `_markdown`): "cache: 7 frames" was shown with 5 patch frames held
        patch_frames = engine.stats()["patch_frames"]
        mirror.wait_for(lambda m: any(f"attention cache: {patch_frames} frames" in str(g["props"].get("_markdown"))
                                      for g in m.gui.values()))
    finally:
        mirror.close()


# ------------------------------------------------------------------------------ chunks and loops


def axis_rotation(axis, degrees: float) -> np.ndarray:
    """[3, 3] rotation by `degrees` about `axis` (Rodrigues)."""
    x, y, z = np.asarray(axis, np.float64) / np.linalg.norm(axis)
    skew = np.array([[0, -z, y], [z, 0, -x], [-y, x, 0]])
    angle = math.radians(degrees)
    return np.eye(3) + math.sin(angle) * skew + (1 - math.cos(angle)) * skew @ skew


def chunk_frame(index: int, chunk_index: int) -> FramePrediction:
    pred = orbit_frame(index, frame_type=FRAME_KEY)
    pred.chunk_index = chunk_index
    return pred


def stream_two_chunks(viewer: LiveViewer) -> None:
    """Frames 0-5 from chunk 0, then 4-9 from chunk 1, which re-emits 4 and 5; every frame a keyframe."""
    for index in range(6):
        viewer.on_frame(chunk_frame(index, 0), {})
    assert viewer.flush()  # 4 and 5 are on screen under chunk 0 before chunk 1 re-emits them
    for index in range(4, 10):
        viewer.on_frame(chunk_frame(index, 1), {})


def node_pose(mirror: SceneMirror, name: str) -> Sim3:
    node = mirror.nodes[name]
    return Sim3(1.0, quat_xyzw_to_rotation(np.roll(np.asarray(node["wxyz"], np.float64), -1)),
                np.asarray(node["position"], np.float64))


def is_posed(mirror: SceneMirror, name: str, transform: Sim3) -> bool:
    """Whether node `name` is at the rotation and translation of `transform`."""
    if name not in mirror.nodes:
        return False
    pose = node_pose(mirror, name)
    return np.allclose(pose.rotation, transform.rotation, atol=1e-6) and np.allclose(
        pose.translation, transform.translation, atol=1e-6)


def cloud(mirror: SceneMirror, keyframe: str) -> np.ndarray:
    return np.asarray(mirror.nodes[f"{keyframe}/points"]["props"]["points"], np.float32).reshape(-1, 3).copy()


def centre(index: int) -> np.ndarray:
    return orbit_frame(index).c2w[:, 3].astype(np.float64)


def test_corrections_move_each_chunk_node_by_its_sim3(viewer):
    mirror = SceneMirror(viewer.url)
    try:
        stream_two_chunks(viewer)
        expected = [f"/chunks/0/f{i:06d}" for i in range(4)] + [f"/chunks/1/f{i:06d}" for i in range(4, 10)]
        mirror.wait_for(lambda m: keyframe_names(m) == expected and f"{expected[-1]}/points" in m.nodes)
        assert is_posed(mirror, "/chunks/1", Sim3.identity())  # no correction yet: the open chain as emitted
        chain_points = cloud(mirror, "/chunks/1/f000006")

        move = Sim3(1.5, axis_rotation([0.2, 1.0, 0.1], 25.0), np.array([0.4, -0.3, 0.8]))
        viewer.apply_corrections(ChunkCorrections({0: Sim3.identity(), 1: move}, version=1))
        mirror.wait_for(lambda m: is_posed(m, "/chunks/1", move)
                        and np.allclose(cloud(m, "/chunks/1/f000006"), 1.5 * chain_points, rtol=2e-3, atol=1e-3))
        for name in expected[4:]:  # scale * R x + t: through both nodes, every point back on the moved plane
            np.testing.assert_allclose(move.inverse().apply_to_points(mirror.world_points(name))[:, 2], PLANE_Z,
                                       atol=0.02)
        np.testing.assert_allclose(mirror.nodes["/chunks/1/f000009"]["position"], 1.5 * centre(9), atol=1e-4)
        # The trajectory and the current camera are in the corrected world.
        mirror.wait_for(lambda m: np.allclose(m.nodes["/current"]["position"], move.apply_to_points(centre(9)),
                                              atol=1e-4))
        mirror.wait_for(lambda m: np.allclose(np.reshape(m.nodes["/trajectory"]["props"]["points"], (-1, 3))[-1],
                                              move.apply_to_points(centre(9)), atol=1e-4))
        # Chunk 0 stays where it was, its clouds sent once.
        assert is_posed(mirror, "/chunks/0", Sim3.identity())
        assert all(mirror.creates[f"{name}/points"] == 1 for name in expected[:4])
        np.testing.assert_allclose(mirror.world_points("/chunks/0/f000002")[:, 2], PLANE_Z, atol=0.02)

        # A newer solve moves chunk 1 again; back at scale 1, its points are the chain's again.
        again = Sim3(1.0, axis_rotation([1.0, 0.0, 0.0], -10.0), np.array([0.0, 0.0, 1.0]))
        viewer.apply_corrections(ChunkCorrections({0: Sim3.identity(), 1: again}, version=2))
        mirror.wait_for(lambda m: is_posed(m, "/chunks/1", again)
                        and np.allclose(cloud(m, "/chunks/1/f000006"), chain_points))
        assert viewer.flush()
        # An older solve arriving late is ignored; a chunk first seen now gets the move of the last one.
        viewer.apply_corrections(ChunkCorrections({0: Sim3.identity(), 1: move}, version=1))
        assert viewer.flush()
        viewer.on_frame(chunk_frame(10, 2), {})
        mirror.wait_for(lambda m: "/chunks/2/f000010/points" in m.nodes)
        assert is_posed(mirror, "/chunks/2", again) and is_posed(mirror, "/chunks/1", again)
    finally:
        mirror.close()


def loop(loop_id: int, query_frame: int, candidate_frame: int, status: str) -> LoopRecord:
    return LoopRecord(loop_id, query_frame, 1, candidate_frame, 0, similarity=0.9, matches=200, inliers=120,
                      status=status)


def loop_segments(mirror: SceneMirror) -> np.ndarray:
    return np.reshape(mirror.nodes["/loops"]["props"]["points"], (-1, 2, 3))


def test_accepted_loops_are_drawn_between_the_corrected_cameras(viewer):
    mirror = SceneMirror(viewer.url)
    try:
        stream_two_chunks(viewer)
        move = Sim3(1.5, axis_rotation([0.0, 1.0, 0.0], 30.0), np.array([1.0, 0.0, -0.5]))
        loops = (loop(0, 9, 1, "accepted"), loop(1, 8, 2, "rejected_by_graph"), loop(2, 40, 3, "accepted"))
        viewer.apply_corrections(ChunkCorrections({0: Sim3.identity(), 1: move}, loops=loops, version=1))
        # Frame 40 is not known yet: one segment, from frame 9 moved with chunk 1 to frame 1 of chunk 0.
        first = np.stack([move.apply_to_points(centre(9)), centre(1)])
        mirror.wait_for(lambda m: "/loops" in m.nodes and np.allclose(loop_segments(m), first[None], atol=1e-4))
        mirror.wait_for(lambda m: "loops: 2 accepted" in readout(m))
        viewer.on_frame(chunk_frame(40, 1), {})
        second = np.stack([move.apply_to_points(centre(40)), centre(3)])
        mirror.wait_for(lambda m: np.allclose(loop_segments(m), np.stack([first, second]), atol=1e-4))

        # A solve that keeps only the rejected loop draws none.
        viewer.apply_corrections(ChunkCorrections({0: Sim3.identity(), 1: move}, loops=loops[1:2], version=2))
        mirror.wait_for(lambda m: "/loops" not in m.nodes and "loops: 0 accepted" in readout(m))
    finally:
        mirror.close()


# ----------------------------------------------------------------------------------------- replay


def write_run(run_dir: Path, num_frames: int, *, size=(42, 56), every_other_keyframe=False) -> None:
    predictions = run_dir / "predictions"
    predictions.mkdir(parents=True)
    for index in range(num_frames):
        frame_type = FRAME_NON_KEY if every_other_keyframe and index % 2 else FRAME_KEY
        if index % 10 == 0:  # a slowly turning camera: fresh geometry every tenth frame is close enough
            pred = orbit_frame(index, size=size, frame_type=frame_type, angle=0.002 * index)
        pred.frame_index, pred.frame_type = index, frame_type
        np.savez(predictions / f"{index:06d}.npz", **prediction_arrays(pred))  # the writers' format


def write_run_json(run_dir: Path, summary: dict) -> None:
    (run_dir / "run.json").write_text(json.dumps({"status": "complete", "summary": summary}), encoding="utf-8")


def test_replay_draws_the_accepted_loops_of_run_json(tmp_path):
    write_run(tmp_path / "run", 30)
    loops = [loop(0, 25, 3, "accepted").as_json(), loop(1, 20, 5, "rejected_by_graph").as_json()]
    write_run_json(tmp_path / "run", {"loop_closure": {"loops": loops}})
    replay = start_replay(tmp_path / "run", port=free_port(), max_points_per_keyframe=300)
    mirror = SceneMirror(replay.viewer.url)
    try:
        # The files are corrected already: the segment joins the two cameras as saved.
        saved = np.stack([replay.index.c2w[25][:, 3], replay.index.c2w[3][:, 3]])
        mirror.wait_for(lambda m: "/loops" in m.nodes and np.allclose(loop_segments(m), saved[None], atol=1e-5))
        mirror.wait_for(lambda m: "loops: 1 accepted" in readout(m))
        replay.seek(10)  # before the loop's query frame: the segment waits for the timeline to reach it
        mirror.wait_for(lambda m: "/loops" not in m.nodes)
    finally:
        mirror.close()
        replay.stop()
        replay.viewer.close()


def test_replay_of_a_run_without_loops_draws_none(tmp_path):
    write_run(tmp_path / "run", 12)
    write_run_json(tmp_path / "run", {"points": {"conf_threshold": 1.0}})  # a run without loop closure
    assert recorded_loops({}) == ()
    assert recorded_loops({"summary": {"loop_closure": {"loops": [{"loop_id": 3}]}}}) == ()  # fields missing
    replay = start_replay(tmp_path / "run", port=free_port(), max_points_per_keyframe=300)
    mirror = SceneMirror(replay.viewer.url)
    try:
        assert loaded(replay)
        mirror.wait_for(lambda m: len(keyframe_names(m)) == 12 and len(m.nodes["/trajectory"]["props"]["points"])
                        == 11 * 6)
        assert "/loops" not in mirror.nodes and "loops:" not in readout(mirror)
    finally:
        mirror.close()
        replay.stop()
        replay.viewer.close()


@pytest.mark.slow
def test_replay_shows_the_run_and_follows_the_timeline(tmp_path):
    write_run(tmp_path / "run", 30, every_other_keyframe=True)
    replay = start_replay(tmp_path / "run", port=free_port(), max_points_per_keyframe=300)
    mirror = SceneMirror(replay.viewer.url)
    try:
        assert replay.position == 29
        assert loaded(replay)
        mirror.wait_for(lambda m: len(keyframe_names(m)) == 15 and "/current" in m.nodes)
        mirror.wait_for(lambda m: len(m.nodes["/trajectory"]["props"]["points"]) == 29 * 6)
        np.testing.assert_allclose(mirror.world_points("/chunks/0/f000028")[:, 2], PLANE_Z, atol=0.02)
        replay.seek(9)  # the timeline moves back: later frames leave the scene
        mirror.wait_for(lambda m: keyframe_names(m) == [f"/chunks/0/f{i:06d}" for i in range(0, 10, 2)])
        mirror.wait_for(lambda m: len(m.nodes["/trajectory"]["props"]["points"]) == 9 * 6)
        replay.play()
        mirror.wait_for(lambda m: len(keyframe_names(m)) == 15, timeout=15)
    finally:
        mirror.close()
        replay.stop()
        replay.viewer.close()


@pytest.mark.slow
def test_replay_of_3000_frames_stays_under_the_caps(tmp_path):
    write_run(tmp_path / "run", 3000, size=(28, 28))
    caps = {"max_points_per_keyframe": 400, "max_total_points": 20_000, "max_keyframes": 120}
    started = time.perf_counter()
    replay = start_replay(tmp_path / "run", port=free_port(), **caps)
    try:
        timings = [time.perf_counter() - started]  # printed, not asserted: a loaded machine may be slow
        assert loaded(replay)
        for position in (1500, 2999):
            started = time.perf_counter()
            replay.seek(position)
            timings.append(time.perf_counter() - started)  # what the timeline slider waits for
            assert loaded(replay)
            summary = replay.viewer.scene_summary()
            # 3 nodes per keyframe, the chunk's node, the trajectory and the current camera
            assert summary["keyframes"] <= 120 and summary["nodes"] <= 3 * 120 + 3
            assert summary["points"] <= 20_000
            assert max(replay.viewer.shown_keyframes()) == position
            assert summary["trajectory_frames"] == position + 1
        print("replay of 3000 frames: open, then seek times (s):", [round(t, 2) for t in timings])
    finally:
        replay.stop()
        replay.viewer.close()


def test_view_command_rejects_a_folder_without_predictions(tmp_path):
    app = Typer()
    app.command(name="view")(view)
    app.command(name="other")(lambda: None)  # two commands, so `view` stays a subcommand as in the CLI
    result = CliRunner().invoke(app, ["view", str(tmp_path)])
    assert result.exit_code == 2
    assert "is not a run directory" in result.output and "Traceback" not in result.output
    (tmp_path / "predictions").mkdir()
    (tmp_path / "predictions" / "000000.npz").write_bytes(b"not an npz")  # a run killed mid-write
    with pytest.raises(RunDirError, match="holds no readable prediction files"):
        index_run(tmp_path)


# ------------------------------------------------------------------------------- headless browser


@pytest.mark.slow  # a headless browser: several seconds
def test_browser_renders_the_points(tmp_path):
    if chromium() is None:
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    # No thumbnails on the frustums, so that the green in the picture can only come from points.
    viewer = LiveViewer(port=free_port(), max_points_per_keyframe=1500, thumbnail_px=0)
    for index in range(10):
        viewer.on_frame(orbit_frame(index, size=(84, 112), frame_type=FRAME_KEY), {"frames": index + 1})
    assert _green_pixels_of(viewer, "viewer_screenshot.png", tmp_path) > 1000


def _green_pixels_of(viewer: LiveViewer, name: str, tmp_path) -> int:
    """The viewer's scene flushed, shot by headless Chromium into ARTIFACTS/name once its centre shows more
    than 1000 green pixels (or at the deadline), and the viewer closed: those green pixels."""
    assert viewer.flush()
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        image = shoot_until(viewer.url, lambda rgb: green_pixels_in_the_centre(rgb) > 1000, ARTIFACTS / name,
                            tmp_path / "chromium")
    finally:
        viewer.close()
    green = 0 if image is None else green_pixels_in_the_centre(image)
    print(f"{name}: green pixels {green} in the centre")
    return green


def test_a_live_viewer_draws_at_most_its_cloud_rate_and_always_the_newest_keyframe():
    """At 40 keyframes a second (keyframes `all`), the live viewer adds clouds for a bounded number
    of them, spread over the stream; the rest extend the trajectory only."""
    live = LiveViewer(port=free_port(), update_hz=20.0, max_new_clouds_per_second=4.0)
    try:
        started = time.perf_counter()
        for index in range(40):  # one second of a 40 FPS stream
            live.on_frame(orbit_frame(index, frame_type=FRAME_KEY), {})
            time.sleep(max(0.0, started + (index + 1) / 40 - time.perf_counter()))
        assert live.flush()
        elapsed = time.perf_counter() - started
        shown = sorted(live.shown_keyframes())
        assert 39 in shown  # the newest is drawn
        assert len(shown) <= 4 * (1 + elapsed) + 1  # the initial bucket and a second's refill, at most
        assert len(shown) >= 2 and shown[0] < 20  # spread over the stream, not only its end
        assert live.scene_summary()["keyframes"] == len(shown)
    finally:
        live.close("complete")
        live.stop()


@pytest.mark.slow
def test_a_newest_keyframe_the_cloud_rate_left_without_a_cloud_gets_one_once_a_token_comes():
    """The bucket holds one cloud and refills every two seconds. The first keyframes spend it (and the newest of
    them is drawn, at once or at the next token); the next keyframe arrives with no token left: it waits, and is
    drawn once the token comes although nothing else arrives; flush waits for it. (Before, it was never drawn:
    the newest keyframe went missing at a stream's end.)"""
    live = LiveViewer(port=free_port(), update_hz=20.0, max_new_clouds_per_second=0.5)
    try:
        started = time.perf_counter()
        for index in range(3):
            live.on_frame(orbit_frame(index, frame_type=FRAME_KEY), {})
        assert live.flush() and 2 in live.shown_keyframes()  # the newest
        live.on_frame(orbit_frame(3, frame_type=FRAME_KEY), {})
        assert live.flush() and 3 in live.shown_keyframes()
        shown = sorted(live.shown_keyframes())
        assert len(shown) <= 1 + 0.5 * (time.perf_counter() - started) + 1e-6  # the rate holds
        assert live.scene_summary()["keyframes"] == len(shown)
    finally:
        live.close("complete")
        live.stop()


@pytest.mark.slow  # two viewer processes
@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_view_stopped_by_a_signal_exits_128_plus_it(tmp_path, signum, code):
    # `view RUN`, then Ctrl-C: exit 0
    write_run(tmp_path / "run", 6)
    command = [sys.executable, "-c", "from stream_recon.app.cli import main; main()", "view", str(tmp_path / "run"),
               "--port", str(free_port())]
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        for line in child.stderr:  # until it serves
            if line.startswith("Replaying 6 frames at http://127.0.0.1:") or time.monotonic() > deadline:
                break
        child.send_signal(signum)
        assert child.wait(timeout=30) == code
    finally:
        if child.poll() is None:
            child.kill()


def readout(mirror: SceneMirror) -> str:
    return " ".join(str(g["props"].get("_markdown")) for g in mirror.gui.values() if "_markdown" in g["props"])


def test_replay_timeline_counts_frame_indices_and_shows_no_missing_image(tmp_path):
    # the slider showed positions (0-3 beside "frame 4"), a run without images a black thumbnail, a replay
    # "FPS 20.0"
    predictions = tmp_path / "run" / "predictions"
    predictions.mkdir(parents=True)
    for index in (0, 2, 4, 6):  # --save-predictions keyframes --no-save-images: every other frame, no image
        pred = orbit_frame(index, frame_type=FRAME_KEY)
        pred.image = None
        np.savez(predictions / f"{index:06d}.npz", **prediction_arrays(pred))
    replay = start_replay(tmp_path / "run", port=free_port())
    mirror = SceneMirror(replay.viewer.url)
    try:
        def timeline(m: SceneMirror) -> tuple:
            props = next(g for g in m.gui.values() if g["props"].get("label") == "Frame")["props"]
            return props["min"], props["max"], props["value"]

        mirror.wait_for(lambda m: "frame **6**" in readout(m) and timeline(m) == (0, 6, 6))
        mirror.set_gui("Frame", 5)  # between two saved frames: the newest one before it
        mirror.wait_for(lambda m: "frame **4**" in readout(m) and timeline(m) == (0, 6, 4))
        assert replay.position == 2
        assert "FPS" not in readout(mirror) and "frames 0-6" in readout(mirror)
        image = next(g for g in mirror.gui.values() if g["props"].get("label") == "current frame")
        assert image["props"]["visible"] is False
    finally:
        mirror.close()
        replay.stop()
        replay.viewer.close()



@pytest.mark.slow
def test_a_run_that_closes_a_loop_moves_the_chunk_nodes_a_client_sees(tmp_path, monkeypatch):
    """The real run loop on the `loop` fixture (tests/loop_standin.py stands in for the model): the final
    correction reaches a connected client before the viewer closes, as the run directory has it."""
    pytest.importorskip("gtsam")
    from loop_standin import (
        StandInModel,
        load_loop_scene,
        registered_frames_folder,
        runs_stream_the_loop_scene,
    )

    from stream_recon.app.options import RunOptions
    from stream_recon.app.outputs.rundir import TRAJECTORY_OPEN_TUM, TRAJECTORY_TUM
    from stream_recon.app.outputs.trajectories import read_tum
    from stream_recon.app.run import pipeline

    scene = load_loop_scene()
    runs_stream_the_loop_scene(monkeypatch, scene, period_s=0.12)
    mirrors = []
    start_viewer = pipeline._start_viewer

    def start_viewer_with_a_client(*args):
        viewer = start_viewer(*args)
        mirrors.append(SceneMirror(viewer.url))
        return viewer

    monkeypatch.setattr(pipeline, "_start_viewer", start_viewer_with_a_client)

    class WaitForTheLoops:
        """Closed after the loop closer's final word went to the viewer, before the viewer closes."""

        def on_frame(self, pred, stats):
            pass

        def close(self, status):
            mirrors[0].wait_for(lambda m: "/loops" in m.nodes and "/chunks/4" in m.nodes
                                and not is_posed(m, "/chunks/4", Sim3.identity()), timeout=30)

    options = RunOptions(device="cpu", chunk_frames=20, overlap=4, loop_closure="on", fps=10.0, port=free_port())
    try:
        summary = pipeline.run_sequence(registered_frames_folder(scene, tmp_path / "frames"), tmp_path / "run",
                                        options, model=StandInModel(), extra_sinks=[WaitForTheLoops()])
        assert summary.ok, summary.error
        # chunk 4's node is where the run directory says chunk 4 moved: open -> corrected, its frames 64-68
        _, open_chain = read_tum(tmp_path / "run" / TRAJECTORY_OPEN_TUM)
        _, corrected = read_tum(tmp_path / "run" / TRAJECTORY_TUM)
        first, last = 64, 68
        rotation = corrected[first, :3, :3] @ open_chain[first, :3, :3].T
        scale = (np.linalg.norm(corrected[last, :3, 3] - corrected[first, :3, 3])
                 / np.linalg.norm(open_chain[last, :3, 3] - open_chain[first, :3, 3]))
        translation = corrected[first, :3, 3] - scale * rotation @ open_chain[first, :3, 3]
        pose = node_pose(mirrors[0], "/chunks/4")
        np.testing.assert_allclose(pose.rotation, rotation, atol=1e-4)
        np.testing.assert_allclose(pose.translation, translation, atol=1e-3)
        assert is_posed(mirrors[0], "/chunks/0", Sim3.identity())
        helpers = json.loads((tmp_path / "run" / "run.json").read_text())["summary"]["helpers"]
        # each that ran, up to the end (frames this small are made model inputs on the reader: no preprocessing pool)
        assert sorted(helpers) == ["child_monitor", "loop_closure", "progress", "reader", "viewer", "writer"], helpers
        assert all(h["up"] for h in helpers.values()) and helpers["viewer"]["when_down"] == "turn off", helpers
    finally:
        for mirror in mirrors:
            mirror.close()


# ------------------------------------------------------------------------------- Gaussian splats


def splat_centres(node: dict) -> tuple[np.ndarray, np.ndarray]:
    """(centres [N, 3], opacities [N] in 0..255) of a GaussianSplatsMessage: viser packs each Gaussian in
    eight uint32 words, the centre's three float32 first and the RGBA bytes last."""
    buffer = np.asarray(node["props"]["buffer"]).view(np.uint8).reshape(-1, 32)
    centres = buffer[:, :12].copy().view(np.float32).reshape(-1, 3)
    return centres.astype(np.float64), buffer[:, 31]


def splats_in_world(mirror: SceneMirror, keyframe: str) -> np.ndarray:
    centres, _ = splat_centres(mirror.nodes[f"{keyframe}/points"])
    node = mirror.nodes[keyframe]  # the keyframe's pose (its chunk node is the identity here)
    rotation = quat_xyzw_to_rotation(np.roll(np.asarray(node["wxyz"], np.float64), -1))
    return centres @ rotation.T + np.asarray(node["position"])


def test_splats_arrive_on_the_surface_and_the_panel_switches_back_to_points():
    viewer = LiveViewer(port=free_port(), max_points_per_keyframe=400, update_hz=20.0, show="splats")
    mirror = SceneMirror(viewer.url)
    try:
        for index in range(4):
            viewer.on_frame(orbit_frame(index, frame_type=FRAME_KEY), {})
        names = [f"/chunks/0/f{i:06d}" for i in range(4)]
        mirror.wait_for(lambda m: all(m.nodes.get(f"{n}/points", {}).get("type") == "GaussianSplatsMessage"
                                      for n in names))
        for name in names:
            world = splats_in_world(mirror, name)
            assert len(world) == 400
            np.testing.assert_allclose(world[:, 2], PLANE_Z, atol=2e-2)  # float16 covariances, float32 centres
        _, opacity = splat_centres(mirror.nodes[f"{names[0]}/points"])
        # confidence 1 .. 2 in the orbit frames: opacity (c - 1) / c from 0 to 0.5
        assert opacity.max() <= 128 and opacity.mean() > 20
        mirror.set_gui("Show as", "points")
        mirror.wait_for(lambda m: all(m.nodes.get(f"{n}/points", {}).get("type") == "PointCloudMessage"
                                      for n in names))
    finally:
        mirror.close()
        viewer.close()


def test_splat_widths_follow_the_sample_spacing():
    frame = orbit_frame(0, size=(40, 60), frame_type=FRAME_KEY)
    sample = sample_keyframe_points(frame, 600)
    centres, covariances, colors, opacities = splat_arrays(sample, 600, 1.0, 1.0, 1.0)
    sigma = np.sqrt(covariances[:, 0, 0])
    expected = 0.5 * np.sqrt(40 * 60 / 600) * centres[:, 2] / frame.intrinsics[0, 0]  # fx < fy: the focal
    np.testing.assert_allclose(sigma, expected, rtol=1e-3)
    np.testing.assert_allclose(covariances[:, 0, 1], 0)
    assert colors.dtype == np.uint8 and opacities.shape == (600, 1)
    _, doubled, _, _ = splat_arrays(sample, 600, 1.0, 2.0, 1.0)  # a chunk scaled 2x: twice as wide
    np.testing.assert_allclose(np.sqrt(doubled[:, 0, 0]), 2 * sigma, rtol=1e-3)


def test_view_refuses_an_unknown_show_in_one_line(tmp_path):
    app = Typer()
    app.command()(view)
    app.command(name="other")(lambda: None)
    result = CliRunner().invoke(app, ["view", str(tmp_path), "--show", "voxels"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert lines == ["error: --show must be one of points, splats, got 'voxels'"]


@pytest.mark.slow  # a headless browser: several seconds
def test_browser_renders_the_splats(tmp_path):
    if chromium() is None:
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium)")
    # 1,600 splats: SwiftShader sorts and draws them within ~10 s on a loaded 2-core machine (15,000 did not
    # draw within a minute)
    viewer = LiveViewer(port=free_port(), max_points_per_keyframe=400, thumbnail_px=0, show="splats")
    for index in range(4):
        frame = orbit_frame(index, size=(84, 112), frame_type=FRAME_KEY)
        frame.depth_conf[:] = 20.0  # opaque splats: the green shows as it is
        viewer.on_frame(frame, {"frames": index + 1})
    assert _green_pixels_of(viewer, "viewer_splats_screenshot.png", tmp_path) > 1000


def test_a_replay_shows_splats_on_the_surface(tmp_path):
    write_run(tmp_path / "run", 8)
    replay = start_replay(tmp_path / "run", port=free_port(), max_points_per_keyframe=300, show="splats")
    mirror = SceneMirror(replay.viewer.url)
    try:
        assert loaded(replay)
        name = "/chunks/0/f000006"
        mirror.wait_for(lambda m: m.nodes.get(f"{name}/points", {}).get("type") == "GaussianSplatsMessage")
        np.testing.assert_allclose(splats_in_world(mirror, name)[:, 2], PLANE_Z, atol=0.02)
    finally:
        mirror.close()
        replay.stop()
        replay.viewer.close()


def test_the_extended_maps_cloud_is_drawn_once_as_its_points_ply_holds_it(viewer, tmp_path):
    rng = np.random.default_rng(0)
    xyz, rgb = rng.uniform(-5, 5, (3000, 3)).astype(np.float32), rng.integers(0, 256, (3000, 3)).astype(np.uint8)
    write_ply(tmp_path / "points.ply", xyz, rgb)
    viewer.show_earlier_map(*read_ply(tmp_path / "points.ply", max_points=1000))
    mirror = SceneMirror(viewer.url)
    try:
        mirror.wait_for(lambda m: "/earlier_map" in m.nodes)
        cloud = mirror.nodes["/earlier_map"]["props"]
        shown = np.asarray(cloud["points"], np.float32).reshape(-1, 3)
        np.testing.assert_allclose(shown, xyz[::3], atol=0.01)  # every third point: 1000 of 3000
        np.testing.assert_array_equal(np.asarray(cloud["colors"]).reshape(-1, 3), rgb[::3])
    finally:
        mirror.close()
