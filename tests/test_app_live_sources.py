"""Live sources against real stream servers on 127.0.0.1, each in a process of its own.

- RTSP: GStreamer's RTSP server (tests/rtsp_camera.py) re-encodes a clip to H.264, as an IP camera does;
- HTTP MJPEG: tests/http_camera.py streams the clip as multipart JPEG, and serves the clip file itself.

The servers are killed with SIGKILL mid-stream and started again on the same port: a live source
reconnects with back-off and keeps every frame it had; a camera that stays away ends the stream with
one clear error after the back-off; a URL to a file that is cut is an end, never reconnected.
Frames carry their clip index as stripes (media_helpers.frame_bgr), so order and gaps are checked.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_until
from media_helpers import ServerProcess, decoded_index, free_port, write_video

from stream_recon.app.run.pipeline import RunOptions, run_sequence
from stream_recon.app.sources.frames import Frame, SourceError, TruncatedSourceError
from stream_recon.app.sources.opening import open_source
from stream_recon.app.sources.reader import FrameSource
from stream_recon.models import GCTStream

pytestmark = pytest.mark.slow  # real server processes, reconnect back-offs: ~30 s for the module

TESTS = Path(__file__).parent
CLIP_FRAMES = 100  # 5 s at 20 fps, looped by the servers
CLIP_FPS = 20
SERVER_LIFETIME_S = 90  # each server exits by itself after this, whatever happens to the test


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MJPG AVI of numbered frames, encoded by OpenCV."""
    return write_video(tmp_path_factory.mktemp("media") / "clip.avi", CLIP_FRAMES, fps=CLIP_FPS, fourcc="MJPG")


def _gstreamer_python() -> tuple[str | None, str]:
    """A Python that can run tests/rtsp_camera.py (Debian's python3-gi is for the system Python)."""
    reasons = []
    for python in dict.fromkeys([sys.executable, "/usr/bin/python3"]):
        if not Path(python).exists():
            continue
        check = subprocess.run([python, str(TESTS / "rtsp_camera.py"), "--check"], capture_output=True, text=True)
        if check.returncode == 0:
            return python, ""
        reasons.append(f"{python}: {check.stdout.strip() or check.stderr.strip()}")
    return None, "; ".join(reasons) or "no Python found"


@pytest.fixture(scope="module")
def rtsp_python() -> str:
    python, reason = _gstreamer_python()
    if python is None:
        pytest.skip(
            "GStreamer's RTSP server is not installed (apt-get install gir1.2-gst-rtsp-server-1.0 python3-gi "
            f"gstreamer1.0-plugins-good gstreamer1.0-plugins-bad; .ci/run does): {reason}"
        )
    return python


def rtsp_camera(python: str, clip: Path) -> tuple[ServerProcess, str]:
    """An RTSP camera server on a free port, not started yet; and the path of its stream."""
    command = [python, str(TESTS / "rtsp_camera.py"), "--port", str(free_port()), "--clip", str(clip),
               "--fps", str(CLIP_FPS), "--lifetime", str(SERVER_LIFETIME_S)]
    return ServerProcess(command), ""


def http_camera(clip: Path, path: str = "/camera.mjpg", file_rate: float = 200_000,
                fps: float = CLIP_FPS) -> tuple[ServerProcess, str]:
    command = [sys.executable, str(TESTS / "http_camera.py"), "--port", str(free_port()), "--clip", str(clip),
               "--fps", str(fps), "--file-rate", str(file_rate), "--lifetime", str(SERVER_LIFETIME_S)]
    return ServerProcess(command), path


@pytest.fixture(params=["rtsp", "mjpeg"])
def camera(request: pytest.FixtureRequest, clip: Path) -> Iterator[tuple[ServerProcess, str]]:
    """A live camera server (RTSP or HTTP MJPEG), started; yields it and its stream URL."""
    if request.param == "rtsp":
        server, path = rtsp_camera(request.getfixturevalue("rtsp_python"), clip)
    else:
        server, path = http_camera(clip)
    with server:
        yield server, server.start() + path


def read_killing_the_server(source: FrameSource, server: ServerProcess, kill_after: int, frames: list[Frame]) -> None:
    """Read `source` to its end into `frames`, killing the server once `kill_after` frames have arrived.

    An error of the source propagates, with the frames before it already in `frames`.
    """
    for frame in source:
        frames.append(frame)
        if len(frames) == kill_after:
            server.kill()


def codes(frames: list[Frame]) -> list[int]:
    return [decoded_index(frame.rgb) for frame in frames]


# ------------------------------------------------------------------ live cameras


def test_live_camera_delivers_the_clip_in_order(camera: tuple[ServerProcess, str]) -> None:
    _, url = camera
    with open_source(url, open_timeout_s=5) as source:
        frames = list(itertools.islice(source, 30))

    assert source.kind == "stream" and source.live and source.estimated_length is None
    assert codes(frames) == list(range(30))
    timestamps = [frame.timestamp for frame in frames]
    assert timestamps[0] == 0.0 and all(np.diff(timestamps) > 0)
    assert source.reconnects == 0 and source.reconnect_attempts == 0 and source.disconnected_s == 0


def test_camera_that_restarts_mid_stream_is_reconnected_and_nothing_is_lost(
    camera: tuple[ServerProcess, str],
) -> None:
    server, url = camera
    source = open_source(url, open_timeout_s=5, reconnect_s=30)

    def restart() -> None:
        # once the reader has found the camera gone and backed off twice
        wait_until(lambda: source.reconnect_attempts >= 2, timeout_s=15)
        server.start()

    restarter = threading.Thread(target=restart)
    frames: list[Frame] = []
    with source:
        for frame in source:
            frames.append(frame)
            if len(frames) == 20:
                server.kill()
                restarter.start()  # the consumer keeps reading meanwhile, so no queued frame is dropped
            if len(frames) == 50:
                break
    restarter.join()

    assert [frame.index for frame in frames] == list(range(50))
    timestamps = [frame.timestamp for frame in frames]
    assert all(np.diff(timestamps) > 0), "timestamps must keep increasing across the reconnection"
    # every frame read before the drop was delivered, then the restarted camera's clip from its start
    received = codes(frames)
    restart = next(index for index in range(1, 50) if received[index] < received[index - 1])
    assert restart >= 20
    assert received[:restart] == list(range(restart))
    assert received[restart:] == list(range(50 - restart))
    assert source.reconnects == 1 and source.reconnect_attempts >= 3 and source.frames_dropped == 0
    # the gap in time covers the time without a connection, which covers the first two back-off waits
    gap = timestamps[restart] - timestamps[restart - 1]
    assert gap >= source.disconnected_s - 0.01 and source.disconnected_s > 0.25 + 0.5


def test_camera_gone_for_good_ends_with_one_error_after_the_back_off(camera: tuple[ServerProcess, str]) -> None:
    server, url = camera
    source = open_source(url, open_timeout_s=5, reconnect_s=2.0)

    frames: list[Frame] = []
    with source, pytest.raises(SourceError) as raised:
        read_killing_the_server(source, server, 10, frames)
    waited_s = time.monotonic() - server.killed_at

    assert f"stream {url} dropped and did not come back within 2 s" in str(raised.value)
    assert "--reconnect SECONDS" in str(raised.value)
    assert codes(frames) == list(range(len(frames))) and len(frames) >= 10  # all kept, in order
    # back-off 0.25, 0.5, 1 s: three attempts fit in 2 s; a refused connection answers at once
    assert source.reconnect_attempts == 3 and source.reconnects == 0
    assert 1.95 <= waited_s < 6.0  # (Event.wait may return a hair early)
    assert source.end_reason == "error"


def test_with_reconnect_off_a_drop_is_the_end_of_the_stream(clip: Path) -> None:
    server, path = http_camera(clip)
    with server:
        url = server.start() + path
        frames: list[Frame] = []
        with open_source(url, open_timeout_s=5, reconnect_s=0) as source:
            read_killing_the_server(source, server, 10, frames)

    assert len(frames) >= 10 and codes(frames) == list(range(len(frames)))
    assert source.end_reason == "end" and source.reconnect_attempts == 0


# ------------------------------------------------------------------ a URL to a file


def test_file_url_is_read_to_its_end_and_not_reconnected(clip: Path) -> None:
    server, _ = http_camera(clip)
    with server:
        url = f"{server.start()}/{clip.name}"
        with open_source(url, open_timeout_s=5) as source:
            frames = list(source)

    assert not source.live and source.estimated_length == CLIP_FRAMES
    assert codes(frames) == list(range(CLIP_FRAMES))
    np.testing.assert_allclose([frame.timestamp for frame in frames], np.arange(CLIP_FRAMES) / CLIP_FPS, atol=1e-6)
    assert source.end_reason == "end" and source.reconnect_attempts == 0


def test_file_url_cut_mid_file_keeps_the_frames_before_and_is_not_reconnected(clip: Path) -> None:
    server, _ = http_camera(clip, file_rate=50_000)  # the clip takes seconds to send
    with server:
        url = f"{server.start()}/{clip.name}"
        source = open_source(url, open_timeout_s=5)
        frames: list[Frame] = []
        with source, pytest.raises(TruncatedSourceError) as raised:
            read_killing_the_server(source, server, 10, frames)

    assert codes(frames) == list(range(len(frames))) and 10 <= len(frames) < CLIP_FRAMES
    assert f"stopped decoding after {len(frames)} of {CLIP_FRAMES} frames" in str(raised.value)
    assert "the connection dropped or the file is truncated" in str(raised.value)
    assert source.reconnect_attempts == 0


# ------------------------------------------------------------------ a whole run


class _RestartCamera:
    """A sink that kills the camera once the run has written `after` frames, then starts it again."""

    def __init__(self, server: ServerProcess, after: int, restart: bool) -> None:
        self.server, self.after, self.restart = server, after, restart
        self.frames_seen = 0

    def on_frame(self, pred: object, stats: dict) -> None:
        self.frames_seen += 1
        if self.frames_seen == self.after:
            self.server.kill()
            if self.restart:
                time.sleep(1.0)  # a few back-off attempts find nobody
                self.server.start()

    def close(self, status: str) -> None:
        """Nothing to close."""


FAST = dict(image_width=56, scale_frames=3, window=4, viewer=False, open_timeout_s=5.0)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("restart", [True, False], ids=["camera-back", "camera-gone"])
def test_run_over_a_camera_that_drops(tmp_path: Path, clip: Path, tiny_model: GCTStream, restart: bool) -> None:
    # A live source keeps only the newest frames when the run falls behind: the camera runs slower than the
    # tiny model on a busy 2-core machine (~5 frames/s end to end), or the 30 frames would be read, most of
    # them dropped, before the drop at the 8th written frame.
    server, path = http_camera(clip, fps=3)
    reconnect_s = 20.0 if restart else 2.0
    with server:
        url = server.start() + path
        summary = run_sequence(
            url, tmp_path / "run", RunOptions(max_frames=30, reconnect_s=reconnect_s, **FAST), model=tiny_model,
            extra_sinks=[_RestartCamera(server, after=8, restart=restart)],
        )

    record = json.loads((tmp_path / "run" / "run.json").read_text())
    written = sorted((tmp_path / "run" / "predictions").glob("*.npz"))
    assert len(written) == summary.frames == record["summary"]["frames_read"]
    tum = np.loadtxt(tmp_path / "run" / "trajectory_tum.txt")
    assert len(tum) == summary.frames and all(np.diff(tum[:, 0]) > 0)
    if restart:
        assert summary.status == "complete" and summary.end_reason == "max_frames" and summary.frames == 30
        assert record["summary"]["reconnects"] == 1 and record["summary"]["disconnected_s"] > 0.25
    else:
        assert summary.status == "failed" and summary.end_reason == "error"
        assert "dropped and did not come back within 2 s" in summary.error
        assert 8 <= summary.frames < 30 and record["status"] == "failed"
        # the back-off tries at 0.25, 0.75 and 1.75 s after the drop, at most three within 2 s; on a loaded machine
        # each refused attempt's own time can push the last past the deadline
        attempts = record["summary"]["reconnect_attempts"]
        assert record["summary"]["reconnects"] == 0 and 1 <= attempts <= 3
        assert f"({attempts} reconnection attempts)" in summary.error
