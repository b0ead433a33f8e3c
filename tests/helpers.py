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
