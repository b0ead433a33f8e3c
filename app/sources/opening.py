"""Opening a source: what the user typed (a video file, an image folder, a webcam index, a stream URL)
classified, checked and opened as a FrameSource, before any model is loaded.

Everything that can be checked is checked here (the file exists and decodes, the folder holds images of one
size, the camera or URL answers within the timeout); why a stream gave no frame is asked of its server
(probing.py), and a file that is not a video is told by its first bytes (signatures.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import cv2
from PIL import Image

from stream_recon.app.sources.frames import SourceError
from stream_recon.app.sources.input_size import input_size_problem
from stream_recon.app.sources.probing import stream_failure
from stream_recon.app.sources.reader import (
    DEFAULT_FRAME_TIMEOUT_S,
    DEFAULT_QUEUE_SIZE,
    FrameSource,
    Reader,
    SourceKind,
)
from stream_recon.app.sources.readers import CaptureReader, FolderReader, check_same_size
from stream_recon.app.sources.settings import (
    DEFAULT_OPEN_TIMEOUT_S,
    DEFAULT_RECONNECT_S,
    FrameSelection,
)
from stream_recon.app.sources.signatures import not_a_video_message, undecodable_file_message
from stream_recon.models.supervision import (
    Helper,
    HelperPolicy,
    WhenDown,
    WhenFull,
    helper_of_thread,
    start_supervised_thread,
)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff", ".webp")
STREAM_SCHEMES = ("rtsp", "rtsps", "rtmp", "http", "https", "udp", "tcp", "srt")
_MAX_SIZE_CHECKS = 200  # picture headers read when a folder is opened
_EXIF_ORIENTATION = 0x0112
# The thread that opens a stream within its deadline, before the run (a reconnection's is the reader's): its
# caller raises what it meets.
OPENER_POLICY = HelperPolicy("the stream's opener", WhenFull.DROP, WhenDown.TURN_OFF, stall_s=60.0)
_ORIENTATIONS_THAT_SWAP_AXES = {5, 6, 7, 8}
# what a video file is called: a folder's videos, a dataset's sequences
VIDEO_SUFFIXES = (
    ".mp4",
    ".mov",
    ".avi",
    ".mkv",
    ".webm",
    ".m4v",
    ".mpg",
    ".mpeg",
    ".wmv",
    ".flv",
    ".ts",
    ".3gp",
)


def open_source(
    spec: str | Path,
    selection: FrameSelection | None = None,
    *,
    image_width: int | None = None,
    open_timeout_s: float = DEFAULT_OPEN_TIMEOUT_S,
    frame_timeout_s: float = DEFAULT_FRAME_TIMEOUT_S,
    queue_size: int = DEFAULT_QUEUE_SIZE,
    reconnect_s: float = DEFAULT_RECONNECT_S,
    rotate: int = 0,
) -> FrameSource:
    """Open a source from what the user typed: a video file, an image folder, `0`, or a URL.

    `image_width`, when given, makes the reader thread also preprocess every frame (Frame.image).
    `reconnect_s` bounds how long a live source that drops is reopened (0: a drop ends the stream).
    `rotate`: degrees every frame is turned clockwise after decoding (FrameSource.turn_clockwise).
    Raises SourceError with a sentence that says what is wrong and what to do.
    """
    selection = selection or FrameSelection()
    kind, location = classify_source(spec)
    options = _SourceOptions(image_width, queue_size, frame_timeout_s, reconnect_s)
    with _read_errors(kind, location):
        if kind == "folder":
            source = _open_folder(Path(location), selection, options)
        elif kind == "video":
            source = _open_video(Path(location), selection, options)
        elif kind == "webcam":
            source = _open_webcam(int(location), selection, options)
        else:
            source = _open_stream(location, open_timeout_s, selection, options)
    source.location = str(Path(location).resolve()) if kind in ("folder", "video") else location
    try:
        source.turn_clockwise(rotate)
    except SourceError:
        source.close()
        raise
    if image_width and source.frame_size is not None:
        problem = input_size_problem(*source.frame_size, image_width)
        if problem is not None:
            source.close()
            raise SourceError(f"{source.description}: {problem}")
    return source


def check_source(spec: str | Path) -> None:
    """Refuse what `open_source` would refuse before it opens anything, in its words: a path that does not
    exist, a single image, a URL of another scheme, a folder without images, a file that is empty or no
    video by its first bytes. Cheap (no decoding; a camera or a stream is not connected to, only told by
    its spelling), so that the CLI says a mistyped source before it loads torch; `open_source` checks the
    rest (the frames decode, one size, the camera answers) when it opens the source, once."""
    kind, location = classify_source(spec)
    with _read_errors(kind, location):
        if kind == "folder":
            _folder_images(Path(location))
        elif kind == "video":
            _check_video_file(Path(location))


@contextlib.contextmanager
def _read_errors(kind: SourceKind, location: str) -> Iterator[None]:
    """An OSError while a source is checked or opened (no permission to read it, a file gone meanwhile, an I/O
    error) as the SourceError that says which file or folder and what to do."""
    try:
        yield
    except OSError as error:
        what = "folder" if kind == "folder" else "file"
        raise SourceError(
            f"cannot read the {what} {error.filename or location}: {error.strerror or error}; "
            "check its permissions or choose another source"
        ) from None


@dataclass(frozen=True)
class _SourceOptions:
    """FrameSource settings that do not depend on the kind of source."""

    image_width: int | None
    queue_size: int
    frame_timeout_s: float
    reconnect_s: float  # used by live sources only

    def as_kwargs(self) -> dict:
        return {"image_width": self.image_width, "queue_size": self.queue_size,
                "frame_timeout_s": self.frame_timeout_s, "reconnect_s": self.reconnect_s}



def classify_source(spec: str | Path) -> tuple[SourceKind, str]:
    """What kind of source the user means, without opening it."""
    text = str(spec).strip()
    if not text:
        raise SourceError("no source given: pass a video file, an image folder, a webcam index or a URL")
    if text.isdigit() and not Path(text).exists():  # a folder or file named 2024 is that folder or file
        return "webcam", text
    scheme = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://", text)
    if scheme:
        if scheme.group(1).lower() not in STREAM_SCHEMES:
            raise SourceError(
                f"unsupported URL scheme {scheme.group(1)!r} in {text}: use one of {', '.join(STREAM_SCHEMES)}"
            )
        return "stream", text
    path = Path(text).expanduser()
    if path.is_dir():
        return "folder", str(path)
    if not path.exists():
        raise SourceError(f"no such file or folder: {path}")
    if path.suffix.lower() in IMAGE_SUFFIXES:
        raise SourceError(
            f"{path} is a single image; pass the folder that holds the sequence ({path.parent}) instead"
        )
    return "video", str(path)


def source_name(spec: str | Path) -> str:
    """A short name for what the user typed, for default output folders (no file is opened).

    clip.mp4 -> clip, frames/ -> frames, 0 -> webcam0, rtsp://cam.local/live -> cam.local_live
    """
    text = str(spec).strip()
    if text.isdigit() and not Path(text).exists():
        return f"webcam{text}"
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", text):
        return _stream_name(text)
    path = Path(text).expanduser()
    name = path.name if path.is_dir() else path.stem
    return name or path.resolve().name or "run"


def natural_sort_key(name: str) -> tuple:
    """frame2.png before frame10.png: digit runs compare as numbers."""
    return tuple(int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name))


def list_images(folder: Path) -> list[Path]:
    """Picture files directly inside `folder` (hidden files skipped), in natural order."""
    files = [
        entry
        for entry in folder.iterdir()
        if entry.is_file() and not entry.name.startswith(".") and entry.suffix.lower() in IMAGE_SUFFIXES
    ]
    return sorted(files, key=lambda entry: natural_sort_key(entry.name))


def _opened_source(
    reader: Reader,
    location: str | Path,
    selection: FrameSelection,
    options: _SourceOptions,
    *,
    kind: SourceKind,
    description: str,
    source_frames: int | None,
    source_fps: float | None = None,
    live: bool,
    frame_size: tuple[int, int] | None,
) -> FrameSource:
    """A source `open_source` opened: named as `source_name` names its location (a default output folder's
    name), its length the selection's share of the source's frames (None: unknown)."""
    return FrameSource(
        reader,
        kind=kind,
        description=description,
        name=source_name(location),
        selection=selection,
        estimated_length=selection.estimate_count(source_frames, source_fps),
        live=live,
        frame_size=frame_size,
        **options.as_kwargs(),
    )


def _folder_images(folder: Path) -> list[Path]:
    """The pictures of an image folder (list_images); SourceError, naming where the frames may be, when it
    holds none."""
    paths = list_images(folder)
    if not paths:
        raise SourceError(
            f"folder {folder} contains no images (looked for {', '.join(IMAGE_SUFFIXES)}); "
            f"{_where_the_frames_may_be(folder)}"
        )
    return paths


def _open_folder(folder: Path, selection: FrameSelection, options: _SourceOptions) -> FrameSource:
    paths = _folder_images(folder)
    frame_size = _check_one_size(paths)
    fps = selection.fps
    reader = FolderReader(paths, frame_size, seconds_per_frame=1.0 / fps if fps else 1.0)
    # file order is the clock here, so an fps selection never drops a file: every kept file is one tick
    return _opened_source(reader, folder, selection, options, kind="folder", description=f"image folder {folder}",
                          source_frames=len(paths), live=False, frame_size=frame_size)


def _where_the_frames_may_be(folder: Path) -> str:
    # datasets often keep frames one level down (TUM: rgb/ and depth/): name those folders
    subfolders = sorted(
        (entry for entry in folder.iterdir() if entry.is_dir() and list_images(entry)),
        key=lambda entry: natural_sort_key(entry.name),
    )
    if subfolders:
        return f"its subfolders {', '.join(entry.name for entry in subfolders)} do: pass one of them"
    videos = sorted(entry.name for entry in folder.iterdir() if entry.suffix.lower() in VIDEO_SUFFIXES)
    if videos:
        return (f"it holds {len(videos)} video{'s' if len(videos) > 1 else ''} ({videos[0]}...): pass one of them, "
                f"or reconstruct each with `stream-recon batch {folder} --output DIR`")
    return "pass a folder of frames, or a video file"


def upright_size(path: Path) -> tuple[int, int]:
    """(width, height) as displayed, read from the header only (no pixel decoding)."""
    try:
        with Image.open(path) as image:
            width, height = image.size
            orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
    except OSError as error:
        raise SourceError(f"{path} is not a readable image ({error}); remove it or replace it") from None
    return (height, width) if orientation in _ORIENTATIONS_THAT_SWAP_AXES else (width, height)


def _check_one_size(paths: list[Path], max_checked: int = _MAX_SIZE_CHECKS) -> tuple[int, int]:
    """The frame size shared by the pictures; a stream is one camera, so mixed sizes are a mistake.

    Up to `max_checked` headers, spread evenly and including the last file, are read now so that a
    mixed folder fails before the model loads; on a network drive every header would take too long
    for 100,000 files. The reader checks every frame as it decodes it.
    """
    step = max(1, math.ceil((len(paths) - 1) / max(1, max_checked - 1)))
    sample = sorted({*range(0, len(paths), step), len(paths) - 1})
    first_size = upright_size(paths[0])
    for index in sample[1:]:
        check_same_size(paths[0], first_size, paths[index], upright_size(paths[index]))
    return first_size


def _check_video_file(path: Path) -> None:
    """SourceError when the file is empty or, by its first bytes, no video (signatures.py)."""
    if path.stat().st_size == 0:
        raise SourceError(f"{path} is empty (0 bytes); it is not a video")
    not_a_video = not_a_video_message(path)
    if not_a_video:
        raise SourceError(not_a_video)


def _open_video(path: Path, selection: FrameSelection, options: _SourceOptions) -> FrameSource:
    _check_video_file(path)
    capture = cv2.VideoCapture(str(path), cv2.CAP_FFMPEG)
    if not capture.isOpened():
        capture.release()
        raise SourceError(undecodable_file_message(path))
    frame_count = _positive_or_none(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    video_fps = _positive_or_none(capture.get(cv2.CAP_PROP_FPS))
    reader = CaptureReader(capture, label=str(path), clock="pts", expected_frames=frame_count)
    reader.peek(f"{path} opened but no frame could be decoded: the video is damaged or uses a codec "
                "this OpenCV build lacks; re-encode it (e.g. ffmpeg -i IN -c:v libx264 OUT.mp4)")
    return _opened_source(reader, path, selection, options, kind="video", description=f"video {path}",
                          source_frames=int(frame_count) if frame_count else None, source_fps=video_fps,
                          live=False, frame_size=_capture_size(capture))


def _open_webcam(index: int, selection: FrameSelection, options: _SourceOptions) -> FrameSource:
    capture = _webcam_capture(index)
    if not capture.isOpened():
        capture.release()
        raise SourceError(
            f"could not open webcam {index}: no camera at that index, or another program is using it "
            "(list cameras with `v4l2-ctl --list-devices` on Linux)"
        )
    reader = CaptureReader(capture, label=f"webcam {index}", clock="wall", expected_frames=None,
                            reopen=lambda _timeout_s: _webcam_capture(index))
    reader.peek(f"webcam {index} opened but sent no frame")
    return _opened_source(reader, str(index), selection, options, kind="webcam", description=f"webcam {index}",
                          source_frames=None, live=True, frame_size=_capture_size(capture))


def _webcam_capture(index: int) -> cv2.VideoCapture:
    capture = cv2.VideoCapture(index)
    if capture.isOpened():
        # the driver's own frame buffer only adds latency: the reader thread already decouples the model
        capture.set(cv2.CAP_PROP_BUFFERSIZE, 1)
    return capture


# RTSP over TCP: FFmpeg's default, RTP over UDP, loses packets on a busy host or network, and one lost
# packet of a key frame drops its whole group of pictures (10-30 frames) without a word. TCP costs a
# little latency and loses nothing. A user who sets OPENCV_FFMPEG_CAPTURE_OPTIONS keeps their own.
RTSP_CAPTURE_OPTIONS = "rtsp_transport;tcp"


def _stream_capture(url: str, open_timeout_s: float, read_timeout_s: float) -> cv2.VideoCapture:
    """An FFmpeg capture of `url`, opened or not; SourceError if the backend ignores the timeout."""
    if url.lower().startswith(("rtsp://", "rtsps://")):
        os.environ.setdefault("OPENCV_FFMPEG_CAPTURE_OPTIONS", RTSP_CAPTURE_OPTIONS)
    params = [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, int(open_timeout_s * 1000),
              cv2.CAP_PROP_READ_TIMEOUT_MSEC, int(read_timeout_s * 1000)]
    return _call_with_deadline(
        lambda: cv2.VideoCapture(url, cv2.CAP_FFMPEG, params),
        # FFmpeg honours the timeout; the extra margin only catches a backend that does not
        deadline_s=open_timeout_s + 5.0,
        on_timeout=f"could not connect to {url} within {open_timeout_s:.0f} s",
    )


def _open_stream(
    url: str, open_timeout_s: float, selection: FrameSelection, options: _SourceOptions
) -> FrameSource:
    started = time.monotonic()
    capture = _stream_capture(url, open_timeout_s, read_timeout_s=open_timeout_s)
    if not capture.isOpened():
        capture.release()
        raise SourceError(
            f"could not open stream {url}: {stream_failure(url, started, open_timeout_s)}; check the address, "
            "that the camera or server is running, and that this machine can reach it"
        )
    frame_count = _positive_or_none(capture.get(cv2.CAP_PROP_FRAME_COUNT))
    # A URL to a file has a length and real timestamps; a camera stream has neither.
    live = frame_count is None
    if live:
        # A reconnection waits no longer than what is left of the back-off; once connected, a frame
        # may take as long to arrive as at the first connection.
        reader = CaptureReader(
            capture, label=url, clock="wall", expected_frames=None,
            reopen=lambda timeout_s: _stream_capture(url, min(timeout_s, open_timeout_s), open_timeout_s),
        )
    else:
        reader = CaptureReader(capture, label=url, clock="pts", expected_frames=frame_count,
                                shortfall_cause="the connection dropped or the file is truncated")
    reader.peek(lambda: f"stream {url} connected but sent no decodable frame: "
                        f"{stream_failure(url, started, open_timeout_s)}")
    return _opened_source(reader, url, selection, options, kind="stream", description=f"stream {url}",
                          source_frames=int(frame_count) if frame_count else None, live=live,
                          frame_size=_capture_size(capture))



def _capture_size(capture: cv2.VideoCapture) -> tuple[int, int] | None:
    """(width, height) an opened capture reports, or None when it reports none."""
    width = _positive_or_none(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
    height = _positive_or_none(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
    return (int(width), int(height)) if width and height else None


def _stream_name(url: str) -> str:
    tail = re.sub(r"^[a-zA-Z0-9+.-]+://", "", url).split("?")[0].rstrip("/")
    return re.sub(r"[^A-Za-z0-9._-]+", "_", tail).strip("_") or "stream"


def _call_with_deadline(open_fn: Callable[[], cv2.VideoCapture], deadline_s: float, on_timeout: str):
    """`open_fn()` on a thread of its own, waited for `deadline_s` at most. The thread is the caller's helper's
    (a reconnection, on the reader's thread: the reader's), or an opener's of its own before the run."""
    result: list[cv2.VideoCapture] = []
    failed: list[Exception] = []

    def open_capture() -> None:
        try:
            result.append(open_fn())
        except Exception as error:  # (raised on the caller's thread, not marking the caller's helper down)
            failed.append(error)

    helper = helper_of_thread(threading.current_thread()) or Helper(OPENER_POLICY)
    opener = start_supervised_thread(helper, open_capture, "stream-open")
    opener.join(timeout=deadline_s)
    if failed:
        raise SourceError(f"opening the stream failed: {type(failed[0]).__name__}: {failed[0]}")
    if not result:
        # the stuck opener is a daemon thread: it cannot keep the process alive
        raise SourceError(f"{on_timeout}; the stream did not answer")
    return result[0]



def _positive_or_none(value: float) -> float | None:
    # OpenCV reports unknown counts as 0, -1 or a huge negative sentinel
    return value if math.isfinite(value) and value > 0 else None
