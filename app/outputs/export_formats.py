"""The export formats: their names, where each goes by default, what each output is called, and which
need the frames' images.

Plain values, free of the libraries that write the formats (trimesh, OpenCV), so that the `export`
command's flags can be read without loading them; app.outputs.export writes them.
"""

from __future__ import annotations

from enum import Enum


class ExportFormat(str, Enum):
    PLY = "ply"
    GLB = "glb"
    COLMAP = "colmap"
    TUM = "tum"
    NERFSTUDIO = "nerfstudio"
    SPLATS = "splats"

    @property
    def label(self) -> str:
        return FORMAT_LABELS[self]

    @property
    def is_folder(self) -> bool:
        """Written as a folder (a model or dataset plus images/), not as one file."""
        return self in FOLDER_CONTENTS

    @property
    def needs_images(self) -> bool:
        """Useless without the frames' images (a model or dataset that names them), as opposed to a format
        that only takes its points' colours from them."""
        return self in FOLDER_CONTENTS

    @property
    def colours_points(self) -> bool:
        """Its points are coloured from the frames' images (grey without them)."""
        return self is not ExportFormat.TUM

    @property
    def suffix(self) -> str:
        """The file suffix a file format is written under ('' for a folder)."""
        return FILE_SUFFIXES.get(self, ("",))[0]

    def accepts_suffix(self, suffix: str) -> bool:
        return suffix.lower() in FILE_SUFFIXES.get(self, ())


FORMAT_LABELS = {
    ExportFormat.PLY: "PLY",
    ExportFormat.GLB: "GLB",
    ExportFormat.COLMAP: "COLMAP",
    ExportFormat.TUM: "TUM",
    ExportFormat.NERFSTUDIO: "nerfstudio",
    ExportFormat.SPLATS: "Gaussian splats",
}
# The suffixes a file format is written under, the usual one first: a GLB is never named .ply.
FILE_SUFFIXES = {
    ExportFormat.PLY: (".ply",),
    ExportFormat.GLB: (".glb",),
    ExportFormat.TUM: (".txt", ".tum"),
    ExportFormat.SPLATS: (".ply",),  # the 3D Gaussian splatting layout is a PLY file too
}
# What a folder format writes in its folder: a folder holding these and nothing else is an earlier
# export of that format (replaced with --overwrite); one holding anything else is someone's folder.
FOLDER_CONTENTS = {
    ExportFormat.COLMAP: ("images", "sparse"),
    ExportFormat.NERFSTUDIO: ("images", "masks", "transforms.json", "points.ply"),  # masks/: a masked run's
}
# A splat export's cap when --max-points is not given: a browser renders about half a million splats
# smoothly, and at 248 bytes each (the reference layout, degree-3 colours) the file is ~124 MB.
DEFAULT_MAX_SPLATS = 500_000
# Under RUN_DIR/exports/ when no --output is given.
DEFAULT_OUTPUT_NAMES = {
    ExportFormat.PLY: "points.ply",
    ExportFormat.GLB: "scene.glb",
    ExportFormat.COLMAP: "colmap",
    ExportFormat.TUM: "trajectory_tum.txt",
    ExportFormat.NERFSTUDIO: "nerfstudio",
    ExportFormat.SPLATS: "splats.ply",
}


def format_summary() -> str:
    """'PLY, GLB, COLMAP, TUM, nerfstudio or Gaussian splats': every format, for help texts."""
    labels = [fmt.label for fmt in ExportFormat]
    return f"{', '.join(labels[:-1])} or {labels[-1]}"
