"""A file that is not a video, told by its first bytes: FFmpeg reads a PNG as a one-frame "video" and a text file
as nothing at all, so an image, a document, an archive or text named .mp4 is named for what it is instead.
"""

from __future__ import annotations

from pathlib import Path


def not_a_video_message(path: Path) -> str | None:
    """A message when the first bytes show the file is something else (FFmpeg would read a PNG as a
    one-frame "video", and a text file as nothing at all); None when it may be a video."""
    with path.open("rb") as file:
        head = file.read(64)
    content = _known_non_video(head)
    if content is None:
        return None
    return (
        f"{path} is not a video file (its content looks like {content}, whatever its name says); "
        "pass a real video (mp4, mov, avi, mkv, ...) or a folder of images"
    )


def undecodable_file_message(path: Path) -> str:
    """Why OpenCV refused a file that did not look like anything else, and what to do about it."""
    with path.open("rb") as file:
        head = file.read(64)
    if head[4:8] == b"ftyp":
        return (
            f"{path} looks like an MP4/MOV file but cannot be opened: it is truncated or damaged (its index "
            "is missing, which happens when a recording is cut off); re-export or re-download it"
        )
    return (
        f"{path} cannot be opened as a video (unknown format or damaged file); "
        "re-encode it (e.g. ffmpeg -i IN -c:v libx264 OUT.mp4) or pass a folder of images"
    )


_NON_VIDEO_SIGNATURES = {
    b"\x89PNG": "a PNG image",
    b"\xff\xd8\xff": "a JPEG image",
    b"GIF8": "a GIF image",
    b"BM": "a BMP image",
    b"%PDF": "a PDF document",
    b"PK\x03\x04": "a ZIP archive",
    b"\x1f\x8b": "a gzip archive",
}


def _known_non_video(head: bytes) -> str | None:
    for signature, meaning in _NON_VIDEO_SIGNATURES.items():
        if head.startswith(signature):
            return meaning
    if head and all(byte in b"\t\n\r" or 32 <= byte < 127 for byte in head):
        return "text"
    return None
