"""An HTTP camera on 127.0.0.1 in a process of its own, so that a test can kill it and start it again.

    python tests/http_camera.py --port 8080 --clip clip.avi [--fps 20] [--file-rate 200000] [--lifetime 60]

Two resources, the two kinds of HTTP source a user may point stream-recon at:
- /camera.mjpg: the clip's frames as a live MJPEG stream (multipart/x-mixed-replace, the HTTP mode
  of most IP cameras), looping, each client from the clip's first frame;
- /<clip file name>: the clip file itself, sent at --file-rate bytes a second like a slow network,
  so that the server can be killed while a client is still reading it.

It prints `ready http://127.0.0.1:PORT` once it accepts connections and exits by itself after
--lifetime seconds, so a test that dies cannot leave it behind.
"""

from __future__ import annotations

import argparse
import threading
import time
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import cv2
from media_helpers import MJPEG_CONTENT_TYPE, mjpeg_part

_CHUNK_BYTES = 4096


def jpeg_frames(clip: Path) -> list[bytes]:
    """The clip's frames, decoded and re-encoded as JPEG once (an IP camera's encoder)."""
    capture = cv2.VideoCapture(str(clip), cv2.CAP_FFMPEG)
    frames = []
    while True:
        ok, bgr = capture.read()
        if not ok:
            break
        frames.append(cv2.imencode(".jpg", bgr)[1].tobytes())
    capture.release()
    if not frames:
        raise SystemExit(f"no frame could be decoded from {clip}")
    return frames


class CameraHandler(BaseHTTPRequestHandler):
    def __init__(self, *args, clip: Path, frames: list[bytes], fps: float, file_rate: float, **kwargs) -> None:
        self.clip, self.frames, self.fps, self.file_rate = clip, frames, fps, file_rate
        super().__init__(*args, **kwargs)

    def do_GET(self) -> None:
        try:
            if self.path == "/camera.mjpg":
                self._send_live()
            elif self.path == f"/{self.clip.name}":
                self._send_file()
            else:
                self.send_error(404)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away

    def _send_live(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", MJPEG_CONTENT_TYPE)
        self.end_headers()
        started = time.monotonic()
        sent = 0
        while True:
            self.wfile.write(mjpeg_part(self.frames[sent % len(self.frames)]))
            self.wfile.flush()
            sent += 1
            # paced against the start, so the stream keeps its rate however long a write took
            time.sleep(max(0.0, started + sent / self.fps - time.monotonic()))

    def _send_file(self) -> None:
        data = self.clip.read_bytes()
        self.send_response(200)
        self.send_header("Content-Type", "video/x-msvideo")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        started = time.monotonic()
        for offset in range(0, len(data), _CHUNK_BYTES):
            self.wfile.write(data[offset : offset + _CHUNK_BYTES])
            time.sleep(max(0.0, started + (offset + _CHUNK_BYTES) / self.file_rate - time.monotonic()))

    def log_message(self, *args: object) -> None:
        """Keep test output clean."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--clip", type=Path, required=True)
    parser.add_argument("--fps", type=float, default=20.0)
    parser.add_argument("--file-rate", type=float, default=200_000.0, help="bytes a second for the clip file")
    parser.add_argument("--lifetime", type=float, default=120.0, help="seconds before the server exits")
    args = parser.parse_args()

    handler = partial(CameraHandler, clip=args.clip, frames=jpeg_frames(args.clip), fps=args.fps,
                      file_rate=args.file_rate)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler)
    server.daemon_threads = True
    threading.Timer(args.lifetime, server.shutdown).start()
    print(f"ready http://127.0.0.1:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
