"""Small helpers the test files share: waiting on a condition with a deadline, the warnings a test logged,
random similarity transforms, and a source file's syntax tree."""

from __future__ import annotations

import ast
import logging
import os
import subprocess
import time
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np

from stream_recon.models.stream.similarity import Sim3

POLL_S = 0.01
# Instants a stop-at-any-instant sweep tries: each is a stream-recon process (~7 s on a 2-core machine), so the
# suite tries 4 a sweep (each stop kind at least once); STREAM_RECON_TEST_INSTANTS=20 runs the full sweeps.
FAULT_INSTANTS = int(os.environ.get("STREAM_RECON_TEST_INSTANTS", "4"))


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0, *, process: subprocess.Popen | None = None,
               what: str = "the condition") -> None:
    """Poll `condition()` until it holds. Fails when `timeout_s` passes (a generous deadline only turns a hang
    into a failure) or when `process` ends first, with what it printed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if process is not None and process.poll() is not None:
            printed = process.stdout.read() if process.stdout else ""
            raise AssertionError(f"the process ended (exit {process.returncode}) before {what}:\n{printed}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout_s} s")
        time.sleep(POLL_S)


def warnings_of(caplog) -> list[str]:
    """The messages logged at WARNING during the test (pytest's caplog)."""
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def random_rotation(rng: np.random.Generator) -> np.ndarray:
    """[3, 3] a rotation drawn uniformly (QR of a Gaussian matrix, its sign fixed)."""
    q, r = np.linalg.qr(rng.normal(size=(3, 3)))
    q *= np.sign(np.diag(r))
    return q * np.sign(np.linalg.det(q))


def random_sim3(rng: np.random.Generator, *, log_scale_sigma: float = 0.5, translation_sigma: float = 5.0) -> Sim3:
    """A similarity with a uniform rotation, a log-normal scale and a Gaussian translation."""
    return Sim3(float(np.exp(rng.normal(0, log_scale_sigma))), random_rotation(rng), rng.normal(0, translation_sigma, 3))


def parsed_source(path: Path) -> ast.Module:
    """`path`'s syntax tree, parsed once a process for each text it had (the rule checks read every module of the
    tree, each check on its own, and also read copies of it with one line changed). Read it, never change it."""
    return _parsed_text(path.read_text())


@lru_cache(maxsize=4096)
def _parsed_text(text: str) -> ast.Module:
    return ast.parse(text)


def idle_child(requests_fd: int, replies_fd: int) -> None:
    """A child process (models/child_process.py's start_child) that waits until its parent closes its pipe."""
    os.read(requests_fd, 1)


def read_run(run_dir: Path) -> list[dict]:
    """Every prediction of a run, in frame order (rundir.iter_run's records), all in memory."""
    from stream_recon.app.outputs.rundir import iter_run

    return list(iter_run(run_dir))


def preprocess_frame(rgb: np.ndarray, image_width: int | None = None) -> np.ndarray:
    """A decoded frame [H, W, 3] uint8 as the reference's float model input [3, H, W] in [0, 1], exactly uint8 / 255."""
    from stream_recon.app.sources.input_size import DEFAULT_IMAGE_WIDTH
    from stream_recon.app.sources.preprocess import preprocess_frame_uint8

    return to_float(preprocess_frame_uint8(rgb, image_width or DEFAULT_IMAGE_WIDTH))


def preprocess_path(path: Path, image_width: int | None = None) -> np.ndarray:
    """A picture file as the reference's float model input [3, H, W]."""
    from stream_recon.app.sources.preprocess import load_image

    return preprocess_image(load_image(path), image_width)


def preprocess_image(image, image_width: int | None = None) -> np.ndarray:
    """A PIL picture as the reference's float model input [3, H, W] in [0, 1], exactly uint8 / 255."""
    from stream_recon.app.sources.input_size import DEFAULT_IMAGE_WIDTH
    from stream_recon.app.sources.preprocess import preprocess_frame_uint8, upright_rgb

    rgb = np.asarray(upright_rgb(image), dtype=np.uint8)  # as a folder's reader makes it
    return to_float(preprocess_frame_uint8(rgb, image_width or DEFAULT_IMAGE_WIDTH))


def to_float(pixels: np.ndarray) -> np.ndarray:
    """uint8 -> float32 in [0, 1]: the one correctly rounded division torchvision's ToTensor does."""
    return pixels.astype(np.float32) / np.float32(255)


def pad_batch(images: list[np.ndarray]) -> np.ndarray:
    """Model inputs of possibly different sizes stacked as the reference batches them: S arrays [3, H_i, W_i] ->
    [S, 3, max H, max W], a smaller image centred and its border white (1.0), an odd extra row at the bottom."""
    if not images:
        raise ValueError("at least one image is needed to make a batch")
    max_height = max(image.shape[1] for image in images)
    max_width = max(image.shape[2] for image in images)
    padded = []
    for image in images:
        rows, cols = max_height - image.shape[1], max_width - image.shape[2]
        top, left = rows // 2, cols // 2
        padding = ((0, 0), (top, rows - top), (left, cols - left))
        padded.append(np.pad(image, padding, mode="constant", constant_values=1.0))
    return np.stack(padded)  # [S, 3, H, W]


def chunk_scales(engine) -> np.ndarray:
    """[n_chunks] the scale of each chunk's transform into chunk 0 (the reference's `chunk_scales`)."""
    return np.array([transform.scale for transform in engine.alignment.transforms])


def chunk_transforms(engine) -> np.ndarray:
    """[n_chunks, 4, 4] [R | t] of each chunk's transform into chunk 0; with `chunk_scales` it maps x -> s R x + t
    (the reference's `chunk_transforms`)."""
    return np.stack([transform.matrix for transform in engine.alignment.transforms])
