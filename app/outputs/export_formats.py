"""The export formats, one entry each: its name, where it goes by default, what its output is called, what it
reads of a run, the function that writes it and what its summary line counts.

Plain values, free of the libraries that write the formats (trimesh, OpenCV), so that the `export`
command's flags can be read without loading them: a format names its writer as "module:function" (a module
of this package), imported on its first export. A new format is one writer (a function of export.py's
`ExportJob`, returning its `ExportResult`) and one member of ExportFormat.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .export import ExportJob, ExportResult


@dataclass(frozen=True, kw_only=True)
class FormatSpec:
    """What the export and its command read of one format."""

    name: str  # --format's word
    label: str  # how messages and help texts name it
    default_name: str  # the file or folder under RUN_DIR/exports/ when no --output is given
    writer: str  # "module:function" writing it, the module one of this package: function(ExportJob) -> ExportResult
    # A file format: the suffixes it is written under, the usual one first (a GLB is never named .ply).
    suffixes: tuple[str, ...] = ()
    # A folder format: what it writes in its folder (images/ among them: the frames, which it needs). A
    # folder holding these and nothing else is an earlier export of the format (replaced with --overwrite);
    # one holding anything else is someone's folder.
    folder_contents: tuple[str, ...] = ()
    # A folder format: the entry of its contents no other export writes (COLMAP's sparse/, nerfstudio's
    # transforms.json): a folder holding it and nothing but the format's contents holds one of its exports, into
    # which no file export writes.
    folder_marker: str = ""
    # Reads the frames' predictions (points, cameras, images); False: the run's trajectory alone.
    reads_frames: bool = True
    # Its own cap on points in place of the run's (None: the run's).
    max_points: int | None = None
    # What its summary line counts: the frames, as what they are to the format; the points (None: none).
    frames_are: str = "camera"
    points_are: str | None = "point"


# A splat export's cap when --max-points is not given: a browser renders about half a million splats
# smoothly, and at 248 bytes each (the reference layout, degree-3 colours) the file is ~124 MB.
DEFAULT_MAX_SPLATS = 500_000


class ExportFormat(str, Enum):
    """The formats `--format` takes, a member each: the member is its name (a str, as typer and run.json
    read it) and carries its FormatSpec."""

    spec: FormatSpec

    def __new__(cls, spec: FormatSpec) -> ExportFormat:
        member = str.__new__(cls, spec.name)
        member._value_ = spec.name
        member.spec = spec
        return member

    PLY = FormatSpec(name="ply", label="PLY", default_name="points.ply", suffixes=(".ply",),
                     writer="export:write_ply_export", frames_are="frame")  # a cloud: no cameras
    GLB = FormatSpec(name="glb", label="GLB", default_name="scene.glb", suffixes=(".glb",),
                     writer="export:write_glb_export")
    COLMAP = FormatSpec(name="colmap", label="COLMAP", default_name="colmap", folder_contents=("images", "sparse"),
                        folder_marker="sparse", writer="export:write_colmap_export")
    # the run's whole trajectory, also the frames saved without an npz
    TUM = FormatSpec(name="tum", label="TUM", default_name="trajectory_tum.txt", suffixes=(".txt", ".tum"),
                     writer="export:write_tum_export", reads_frames=False, frames_are="pose",
                     points_are=None)
    NERFSTUDIO = FormatSpec(name="nerfstudio", label="nerfstudio", default_name="nerfstudio",
                            folder_contents=("images", "masks", "transforms.json", "points.ply"),  # masks/: a masked run's
                            folder_marker="transforms.json", writer="export:write_nerfstudio_export")
    # the 3D Gaussian splatting layout is a PLY file too
    SPLATS = FormatSpec(name="splats", label="Gaussian splats", default_name="splats.ply", suffixes=(".ply",),
                        writer="export:write_splats_export", max_points=DEFAULT_MAX_SPLATS,
                        points_are="splat")

    @property
    def label(self) -> str:
        return self.spec.label

    @property
    def is_folder(self) -> bool:
        """Written as a folder (a model or dataset plus images/), not as one file."""
        return bool(self.spec.folder_contents)

    @property
    def needs_images(self) -> bool:
        """Useless without the frames' images (a model or dataset that names them), as opposed to a format
        that only takes its points' colours from them."""
        return "images" in self.spec.folder_contents

    @property
    def writes_masks(self) -> bool:
        """Writes a masked frame's mask beside its image (masks/)."""
        return "masks" in self.spec.folder_contents

    @property
    def suffix(self) -> str:
        """The file suffix a file format is written under ('' for a folder)."""
        return (*self.spec.suffixes, "")[0]

    def accepts_suffix(self, suffix: str) -> bool:
        return suffix.lower() in self.spec.suffixes

    def writer(self) -> Callable[[ExportJob], ExportResult]:
        """The function that writes this format (its module imported now, if it was not)."""
        module, _, function = self.spec.writer.partition(":")
        return getattr(importlib.import_module(f".{module}", __package__), function)


def folder_export_in(entries: set[str]) -> ExportFormat | None:
    """The folder format whose export a folder of these entries (names, hidden ones left out) holds, or None."""
    return next((fmt for fmt in ExportFormat if fmt.is_folder and fmt.spec.folder_marker in entries
                 and entries <= set(fmt.spec.folder_contents)), None)


def format_summary() -> str:
    """'PLY, GLB, COLMAP, TUM, nerfstudio or Gaussian splats': every format, for help texts."""
    labels = [fmt.label for fmt in ExportFormat]
    return f"{', '.join(labels[:-1])} or {labels[-1]}"
