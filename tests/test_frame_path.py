"""One frame's path from the source to the writer: at most 13 hops on at most 2 threads, and the writer's own
part (on_frame to its npz) at most 6 hops on a thread of its own.

The rule. A hop is one of our functions (app/, models/, cache/) on the call stack at a point where the frame
changes hands or form: its pixels decoded, made a model input, queued, taken off a queue, stepped through the
model, made a prediction, handed to the writer, taken by the writer thread, written to its npz. On each
thread, the hops are the functions of those stacks from the deepest one they share (the thread's loop) down;
inside the model, only the call into it counts (its layers are the step). From the source to the writer
means up to, not including, the writer's first function on the run loop's thread (RunWriter.on_frame): the
writer's part (that function, its hand-off, its thread down to the npz) is counted apart. The threads on the
critical path are those the frame crosses before the writer: the writer's thread is off it, which needs the
npz written on a thread that is not the run loop's.

How it is walked: a real video streams through `run_sequence` with the tiny model while a profile function
(sys.setprofile on every thread) watches for frame K's pixels, found by the index the video's stripes carry
(tests/media_helpers.py), so no function of ours is named to find them. An indirection added anywhere on the
way (a wrapper that forwards the frame, a relay that carries it across a layer, a thread or pool it passes
through) adds a hop or a thread and fails this test; docs/ARCHITECTURE.md ("One frame's path") draws the
same hops, one numbered line each, and must name exactly the hops walked here.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from types import CodeType, FrameType

import numpy as np
import pytest
import torch
from media_helpers import decoded_index, write_video

import stream_recon.app
from stream_recon.app.options import RunOptions
from stream_recon.app.run.pipeline import run_sequence
from stream_recon.app.sources.input_size import model_input_size
from stream_recon.models import GCTStream
from stream_recon.models.stream.prediction import FramePrediction

REPO = Path(stream_recon.app.__file__).resolve().parents[1]
OURS = tuple(f"{REPO / room}/" for room in ("app", "models", "cache"))
THE_MODEL = tuple(f"{REPO / room}/" for room in ("models/network", "cache"))  # the step's inside
HAND_OFF = f"{REPO}/models/supervision.py"  # HandOff: the bounded hand-off to a helper thread
# 12 along the way, and the run loop's take from the reader's hand-off (models/supervision.py's HandOff, which
# runs the reader's policy, where the standard library's queue took it)
MOST_HOPS_TO_THE_WRITER = 13
MOST_HOPS_IN_THE_WRITER = 6
# the reader, which makes the model input of a frame up to app/sources/preprocessing_pool.py's POOL_FROM_PIXELS (a larger one's
# is made on the preprocessing pool, a third thread), and the run loop
MOST_CRITICAL_THREADS = 2

VIDEO_SIZE = (160, 96)  # (width, height): 8 stripes of 20 pixels; model inputs 56x28, stripes of 7
IMAGE_WIDTH = 56
K = 5  # a streaming frame (after the 3 scale frames), emitted by its own push on the CPU
FAST = dict(image_width=IMAGE_WIDTH, scale_frames=3, window=4, viewer=False, conf_threshold=1.0, device="cpu")


@dataclasses.dataclass(frozen=True)
class Hop:
    path: str  # relative to the repository
    name: str  # qualified: Class.method, function, outer.<locals>.inner

    def __str__(self) -> str:
        return f"{self.path}:{self.name}"


@dataclasses.dataclass(frozen=True)
class Probe:
    """One point of the frame's path: what happened there, on which thread, and our frames on the stack
    (outermost first)."""

    event: str
    thread: int
    thread_name: str
    stack: tuple[Hop, ...]


def is_ours(code: CodeType) -> bool:
    return code.co_filename.startswith(OURS)


def hop_of(frame: FrameType) -> Hop:
    code = frame.f_code
    name = getattr(code, "co_qualname", None)  # (Python 3.11+; before, the class from the frame's self)
    if name is None:
        owner = frame.f_locals.get("self")
        name = code.co_name if owner is None else f"{type(owner).__name__}.{code.co_name}"
    return Hop(str(Path(code.co_filename).relative_to(REPO)), name)


def shows_frame(value: object, index: int, size: tuple[int, int] | None = None, depth: int = 0) -> bool:
    """Whether `value` holds frame `index`'s pixels (an image [H, W, 3] or [3, H, W], alone or in a batch, uint8
    or float in [0, 1]; of `size` (height, width) when given), itself or one container level down."""
    if isinstance(value, (np.ndarray, torch.Tensor)):
        return any(decoded_index(image) == index for image in images_in(value, size))
    if depth >= 2:
        return False
    if isinstance(value, Future):  # a frame still being made elsewhere shows once it is made
        return value.done() and not value.cancelled() and value.exception(timeout=0) is None and shows_frame(
            value.result(timeout=0), index, size, depth + 1)
    if isinstance(value, dict):
        return any(shows_frame(item, index, size, depth + 1) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(shows_frame(item, index, size, depth + 1) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(shows_frame(getattr(value, field.name), index, size, depth + 1)
                   for field in dataclasses.fields(value))
    return False


def images_in(value: np.ndarray | torch.Tensor, size: tuple[int, int] | None) -> list[np.ndarray]:
    """[H, W, 3] uint8 images of an array that looks like an image or a batch of them; none otherwise."""
    if value.ndim not in (3, 4):
        return []
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    batch = value.reshape(-1, *value.shape[-3:])
    if batch.shape[-1] != 3:
        batch = np.moveaxis(batch, 1, -1)  # [S, 3, H, W] -> [S, H, W, 3]
    if batch.shape[-1] != 3 or batch.shape[2] < 16 or (size is not None and batch.shape[1:3] != size):
        return []
    if batch.dtype != np.uint8:
        batch = np.clip(batch.astype(np.float32) * 255, 0, 255)
    return list(batch)


class FramePathWalk:
    """Records the probes of frame `index`'s path while installed (every thread started meanwhile too)."""

    def __init__(self, index: int, source_size: tuple[int, int], input_size: tuple[int, int]) -> None:
        self.index, self.source_size, self.input_size = index, source_size, input_size
        self.probes: list[Probe] = []
        self.errors: list[str] = []
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __enter__(self) -> FramePathWalk:
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc_info: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        try:
            if event == "call":
                self._on_call(frame)
            elif event == "return" and arg is not None:
                self._on_return(frame, arg)
        except Exception as error:  # noqa: BLE001 - a profile function that raises is switched off: say so instead
            self.errors.append(f"{type(error).__name__}: {error}")

    def _on_call(self, frame: FrameType) -> None:
        code = frame.f_code
        if code.co_name == "put" and code.co_filename.endswith("queue.py"):
            if shows_frame(frame.f_locals.get("item"), self.index):
                self._record("queued", frame.f_back)
        elif code.co_name in ("offer", "give") and code.co_filename.endswith(HAND_OFF):
            if shows_frame(frame.f_locals.get("item"), self.index):
                self._record("queued", frame)
        elif code.co_name in ("savez", "savez_compressed") and "numpy" in code.co_filename:
            if frame.f_locals.get("kwds", {}).get("frame_index") == self.index:
                self._record("written", frame.f_back)
        elif code.co_filename.startswith(THE_MODEL) and "stepped" not in self._seen and not self._inside_model(frame):
            if any(shows_frame(value, self.index, self.input_size) for name, value in frame.f_locals.items()
                   if name != "self"):
                self._record("stepped", frame, once=True)

    def _on_return(self, frame: FrameType, value: object) -> None:
        code = frame.f_code
        if code.co_name == "get" and code.co_filename.endswith("queue.py"):
            if shows_frame(value, self.index):
                self._record("taken", frame.f_back)
            return
        if code.co_name == "take" and code.co_filename.endswith(HAND_OFF):
            if value[0] and shows_frame(value[1], self.index):  # (taken, item)
                self._record("taken", frame)
            return
        if not is_ours(code) or code.co_filename.startswith(THE_MODEL):
            return
        if "decoded" not in self._seen and shows_frame(value, self.index, self.source_size[::-1]):
            self._record("decoded", frame, once=True)
        elif ("model input" not in self._seen and isinstance(value, (np.ndarray, torch.Tensor))
              and tuple(value.shape) == (3, *self.input_size) and shows_frame(value, self.index)):
            self._record("model input", frame, once=True)  # [3, H, W], as the engine takes it
        elif "predicted" not in self._seen and any(
                isinstance(item, FramePrediction) and item.frame_index == self.index
                for item in (value if isinstance(value, list) else [value])):
            self._record("predicted", frame, once=True)

    @staticmethod
    def _inside_model(frame: FrameType) -> bool:
        caller = frame.f_back
        while caller is not None and not is_ours(caller.f_code):
            caller = caller.f_back
        return caller is not None and caller.f_code.co_filename.startswith(THE_MODEL)

    def _record(self, event: str, frame: FrameType | None, once: bool = False) -> None:
        stack = []
        while frame is not None:
            if is_ours(frame.f_code):
                stack.append(hop_of(frame))
            frame = frame.f_back
        thread = threading.current_thread()
        with self._lock:
            if once and event in self._seen:
                return
            self._seen.add(event)
            self.probes.append(Probe(event, thread.ident, thread.name, tuple(reversed(stack))))


@dataclasses.dataclass
class FramePath:
    to_the_writer: list[Hop]  # in the order the frame meets them
    in_the_writer: list[Hop]
    critical_threads: list[str]  # the threads of the hops to the writer
    writer_thread: str  # where the npz is written
    run_loop_thread: str


def frame_path(probes: list[Probe]) -> FramePath:
    """The hops of the probes by the rule in this module's docstring."""
    by_thread: dict[int, list[Probe]] = {}
    for probe in probes:
        by_thread.setdefault(probe.thread, []).append(probe)
    written = next(probe for probe in probes if probe.event == "written")
    run_loop = next(probe for probe in probes if probe.event == "stepped")
    writer_class = segment(by_thread[written.thread])[0].name.split(".")[0]
    # Where another thread handed the frame to the writer: the writer's functions there, from its first down.
    writers: set[Hop] = set()
    for probe in probes:
        firsts = [i for i, hop in enumerate(probe.stack) if hop.name.startswith(f"{writer_class}.")]
        if probe.event == "queued" and probe.thread != written.thread and firsts:
            writers.update(probe.stack[firsts[0]:])
    to_the_writer, in_the_writer, threads = [], [], {}
    for thread, thread_probes in by_thread.items():
        for hop in segment(thread_probes):
            if thread == written.thread or hop in writers:
                in_the_writer.append(hop)
            else:
                to_the_writer.append(hop)
                threads[thread] = thread_probes[0].thread_name
    return FramePath(to_the_writer, in_the_writer, list(threads.values()), written.thread_name,
                     run_loop.thread_name)


def segment(probes: list[Probe]) -> list[Hop]:
    """One thread's hops: the frames of its probes' stacks from the deepest one they all share down, in the
    order the probes came."""
    stacks = [probe.stack for probe in probes]
    shared = 0
    while all(len(stack) > shared for stack in stacks) and len({stack[shared] for stack in stacks}) == 1:
        shared += 1
    hops: list[Hop] = []
    for stack in stacks:
        hops += [hop for hop in stack[max(shared - 1, 0):] if hop not in hops]
    return hops


def documented_hops() -> list[Hop]:
    """The numbered hop lines of docs/ARCHITECTURE.md's "One frame's path", in order."""
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("\n## One frame's path\n", 1)[1].split("\n## ", 1)[0]
    lines = re.findall(r"^\s*(\d+)\s+(\S+\.py):(\S+)", section, flags=re.MULTILINE)
    assert [int(number) for number, _, _ in lines] == list(range(1, len(lines) + 1)), "hops numbered 1, 2, ..."
    return [Hop(path, name) for _, path, name in lines]


@pytest.fixture(scope="module")
def walked(tmp_path_factory: pytest.TempPathFactory, tiny_model: GCTStream, one_torch_thread) -> tuple[FramePath, str]:
    """Frame K's path through a real run: its hops, and the probes' stacks drawn for failure messages."""
    folder = tmp_path_factory.mktemp("frame_path")
    video = write_video(folder / "clip.mp4", 10, width=VIDEO_SIZE[0], height=VIDEO_SIZE[1], fps=20)
    input_size = model_input_size(*VIDEO_SIZE, IMAGE_WIDTH)
    with FramePathWalk(K, VIDEO_SIZE, input_size) as walk:
        summary = run_sequence(str(video), folder / "run", RunOptions(**FAST), model=tiny_model)
    assert summary.status == "complete" and summary.frames == 10, summary
    assert walk.errors == []
    missing = {"decoded", "model input", "queued", "taken", "stepped", "predicted", "written"} - {
        probe.event for probe in walk.probes}
    # A probe that never fired means the path changed shape under this walk (a hand-off that is no
    # queue.Queue, a write that is no np.savez): the walk must learn the new shape, not skip it.
    assert not missing, f"frame {K}'s path was not seen at: {sorted(missing)}"
    drawn = "\n".join(f"{probe.event} on {probe.thread_name}: {' > '.join(map(str, probe.stack))}"
                      for probe in walk.probes)
    return frame_path(walk.probes), drawn


def test_one_frame_reaches_the_writer_in_at_most_12_hops_on_at_most_2_threads(walked):
    path, drawn = walked
    assert len(path.to_the_writer) <= MOST_HOPS_TO_THE_WRITER, (
        f"{len(path.to_the_writer)} hops from the source to the writer:\n"
        + "\n".join(map(str, path.to_the_writer)) + f"\n\n{drawn}")
    assert len(path.critical_threads) <= MOST_CRITICAL_THREADS, f"the frame crossed {path.critical_threads}\n{drawn}"


def test_the_writer_writes_the_frame_on_its_own_thread_in_at_most_6_hops(walked):
    path, drawn = walked
    assert len(path.in_the_writer) <= MOST_HOPS_IN_THE_WRITER, (
        f"{len(path.in_the_writer)} hops in the writer:\n" + "\n".join(map(str, path.in_the_writer)) + f"\n\n{drawn}")
    # off the critical path only on a thread of its own (the run loop waits for it only when its hand-off is full)
    assert path.writer_thread not in path.critical_threads and path.writer_thread != path.run_loop_thread


def test_the_architecture_doc_draws_exactly_the_hops_walked(walked):
    path, _ = walked
    walked_hops = path.to_the_writer + path.in_the_writer
    drawn = documented_hops()
    assert sorted(map(str, drawn)) == sorted(map(str, walked_hops)), (
        "docs/ARCHITECTURE.md's numbered hops:\n" + "\n".join(map(str, drawn))
        + "\n\nthe hops walked:\n" + "\n".join(map(str, walked_hops)))
