"""Real media for the app tests: videos encoded by OpenCV, image folders, local MJPEG HTTP cameras,
and stream servers run as processes of their own (tests/rtsp_camera.py, tests/http_camera.py)."""

from __future__ import annotations

import contextlib
import math
import os
import select
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import cv2
import numpy as np

NUM_CODE_BITS = 8


def frame_bgr(index: int, width: int, height: int) -> np.ndarray:
    """A frame that carries its index (mod 256) as 8 black or white vertical stripes, low bit first.

    Stripes survive lossy codecs (mp4v, MJPG, JPEG) where a small grey-level code would not.
    """
    frame = np.zeros((height, width, 3), dtype=np.uint8)
    stripe = width // NUM_CODE_BITS
    for bit in range(NUM_CODE_BITS):
        if (index >> bit) & 1:
            frame[:, bit * stripe : (bit + 1) * stripe] = 255
    return frame


def decoded_index(rgb: np.ndarray) -> int:
    """The index a decoded frame carries (inverse of frame_bgr), read at the centre of each stripe."""
    stripe = rgb.shape[1] // NUM_CODE_BITS
    centres = rgb[:, stripe // 2 :: stripe][:, :NUM_CODE_BITS].mean(axis=(0, 2))
    return sum(1 << bit for bit, level in enumerate(centres) if level > 127)


def write_video(
    path: Path, num_frames: int, *, width: int = 160, height: int = 96, fps: float = 20.0, fourcc: str = "mp4v"
) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), fps, (width, height))
    assert writer.isOpened(), f"OpenCV cannot write {fourcc} to {path}"
    for index in range(num_frames):
        writer.write(frame_bgr(index, width, height))
    writer.release()
    return path


def write_noise_video(path: Path, num_frames: int, width: int, height: int, fps: float = 30.0) -> Path:
    """Frames of random pixels: large decoded frames that do not compress away."""
    rng = np.random.default_rng(0)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (width, height))
    tile = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    for index in range(num_frames):
        writer.write(np.roll(tile, index * 7, axis=1))
    writer.release()
    return path


def truncate_file(path: Path, keep_fraction: float) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    return path


def write_image_folder(folder: Path, names: list[str], *, width: int = 64, height: int = 48) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for index, name in enumerate(names):
        cv2.imwrite(str(folder / name), frame_bgr(index, width, height))
    return folder


def rss_bytes() -> int:
    """Resident set size of this process (Linux)."""
    with open(f"/proc/{os.getpid()}/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


MJPEG_CONTENT_TYPE = "multipart/x-mixed-replace; boundary=frame"


def mjpeg_part(jpeg: bytes) -> bytes:
    """One picture of a multipart/x-mixed-replace stream: boundary, headers, the JPEG bytes."""
    header = f"--frame\r\nContent-Type: image/jpeg\r\nContent-Length: {len(jpeg)}\r\n\r\n"
    return header.encode() + jpeg + b"\r\n"


class _MjpegHandler(BaseHTTPRequestHandler):
    """multipart/x-mixed-replace JPEG stream, the protocol of most IP cameras' HTTP mode."""

    num_frames = 40
    interval_s = 0.01
    stall_after: int | None = None  # stop sending (connection kept open) after this many frames
    released: threading.Event
    width, height = 160, 96

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", MJPEG_CONTENT_TYPE)
        self.end_headers()
        for index in range(self.num_frames):
            if index == self.stall_after:
                self.released.wait(timeout=60)
                return
            _, jpeg = cv2.imencode(".jpg", frame_bgr(index, self.width, self.height))
            try:
                self.wfile.write(mjpeg_part(jpeg.tobytes()))
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError):
                return
            time.sleep(self.interval_s)

    def log_message(self, *args: object) -> None:
        """Keep test output clean."""


@contextlib.contextmanager
def mjpeg_server(
    num_frames: int = 40, interval_s: float = 0.01, stall_after: int | None = None
) -> Iterator[str]:
    """Serve an MJPEG camera on 127.0.0.1; yields its URL."""
    released = threading.Event()
    handler = type(
        "Handler",
        (_MjpegHandler,),
        {"num_frames": num_frames, "interval_s": interval_s, "stall_after": stall_after, "released": released},
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/camera.mjpg"
    finally:
        released.set()
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def silent_server() -> Iterator[int]:
    """A TCP port on 127.0.0.1 that accepts connections and never answers; yields the port."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept_forever() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept_forever, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=2)
        for connection in accepted:
            connection.close()
        listener.close()


def free_port() -> int:
    """A port on 127.0.0.1 with nothing listening (connections are refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """A stream server in a process of its own, on one 127.0.0.1 port, that a test kills and restarts.

    `command` must print a line `ready URL` once the server accepts connections (tests/rtsp_camera.py
    and tests/http_camera.py do). Leaving the `with` block kills the process, whatever happened.
    """

    def __init__(self, command: list[str], ready_timeout_s: float = 30.0) -> None:
        self._command = command
        self._ready_timeout_s = ready_timeout_s
        self._process: subprocess.Popen | None = None
        self.killed_at = math.nan  # time.monotonic() of the last kill

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.kill()

    def start(self) -> str:
        """Start the server and wait until it serves; returns its base URL."""
        assert self._process is None, "the server is already running"
        # a file, not a pipe, for the server's log: a full pipe would block a chatty server mid-stream
        log = tempfile.TemporaryFile(mode="w+")
        process = subprocess.Popen(self._command, stdout=subprocess.PIPE, stderr=log, text=True)
        self._process, self._log = process, log
        ready, _, _ = select.select([process.stdout], [], [], self._ready_timeout_s)
        line = process.stdout.readline() if ready else ""
        if not line.startswith("ready "):
            log.seek(0)
            message = f"{' '.join(self._command)} did not start: {line}{log.read()}"
            self.kill()
            raise RuntimeError(message)
        return line.split()[1]

    def kill(self) -> None:
        """SIGKILL, as a crash or a power cut would: the server says goodbye to nobody."""
        if self._process is not None:
            self._process.kill()
            self.killed_at = time.monotonic()
            self._process.wait(timeout=10)
            self._process.stdout.close()
            self._log.close()
            self._process = None
