"""Screenshots of a page in headless Chromium, taken over the DevTools protocol until the picture shows what
the test waits for, or a deadline passes.

Chromium's own `--screenshot` with a virtual-time budget never returned for the Gaussian-splat scene on a
loaded machine (its sorting worker keeps virtual time from advancing: the 90 s timeout, every try), and a
short budget shot the page before the scene arrived. Real time and a predicate do not depend on either.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import cv2
import numpy as np
import websockets.sync.client
from media_helpers import free_port

SHOT_DEADLINE_S = 60.0  # the splat scene drew within ~10 s under two busy loops on a 2-core machine
SHOT_INTERVAL_S = 0.5


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def green_pixels_in_the_centre(image_rgb: np.ndarray) -> int:
    """Green cells of the test scenes' checkerboard; the background is white, frustums grey and orange, the
    path red."""
    h, w = image_rgb.shape[:2]
    centre = image_rgb[h // 4 : 3 * h // 4, w // 6 : w // 2 + w // 6].reshape(-1, 3).astype(int)
    return int(((centre[:, 1] > centre[:, 0] + 40) & (centre[:, 1] > centre[:, 2] + 40)).sum())


def shoot_until(url: str, done: Callable[[np.ndarray], bool], screenshot: Path, profile: Path,
                deadline_s: float = SHOT_DEADLINE_S) -> np.ndarray | None:
    """Load `url` in headless Chromium (SwiftShader's software WebGL) and take screenshots until `done(rgb)`
    holds or `deadline_s` passes; the last one is written to `screenshot` and returned (None: none was taken)."""
    port = free_port()
    command = [
        chromium() or "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--use-angle=swiftshader",
        "--enable-unsafe-swiftshader", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}", "--window-size=1024,768",
        f"--remote-debugging-port={port}", url,
    ]  # fmt: skip
    browser = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "HOME": str(profile)})
    ends = time.monotonic() + deadline_s
    image = None
    try:
        with websockets.sync.client.connect(_page_socket(port, ends), max_size=None, open_timeout=10) as page:
            ids = itertools.count(1)
            while time.monotonic() < ends:
                image = _capture(page, next(ids), ends)
                if image is not None and done(image):
                    break
                time.sleep(SHOT_INTERVAL_S)
    finally:
        browser.kill()
        browser.wait(timeout=30)
    if image is not None:
        cv2.imwrite(str(screenshot), image[..., ::-1])
    return image


def _page_socket(port: int, ends: float) -> str:
    """The DevTools WebSocket of the browser's page, once the browser answers."""
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as answer:
                pages = [target for target in json.load(answer) if target.get("type") == "page"]
            if pages:
                return pages[0]["webSocketDebuggerUrl"]
        except OSError:
            pass
        if time.monotonic() > ends:
            raise TimeoutError(f"headless Chromium did not open its DevTools port {port}")
        time.sleep(0.2)


def _capture(page, request_id: int, ends: float) -> np.ndarray | None:
    """One screenshot of the page as RGB (None if the page had none to give before `ends`)."""
    page.send(json.dumps({"id": request_id, "method": "Page.captureScreenshot", "params": {"format": "png"}}))
    while time.monotonic() < ends:
        try:
            message = json.loads(page.recv(timeout=max(0.1, ends - time.monotonic())))
        except TimeoutError:
            return None
        if message.get("id") != request_id:
            continue  # an event of the page's
        if "result" not in message:
            return None
        png = np.frombuffer(base64.b64decode(message["result"]["data"]), dtype=np.uint8)
        return cv2.imdecode(png, cv2.IMREAD_COLOR)[..., ::-1]
    return None
