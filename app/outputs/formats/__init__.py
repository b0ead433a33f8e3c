"""The export formats: one file each in this folder, and the table they make.

A format's file holds its `SPEC` (app/outputs/export_job.py's FormatSpec: its name, which is the file's,
where it goes, what it reads, what its summary line counts) and its writer. The table is the folder: this
module lists its files and imports each for its spec; `ExportFormat` has a member a format, in the order the
specs' `listed` gives, and says where a format's export may go (`file_target`, `folder_target`: the suffixes
and folder contents its spec names). Adding a format is one file here (docs/ARCHITECTURE.md, "How to add").

Every file's top imports only light modules (NumPy, plyfile, the run directory's), so that the `export`
command's flags and help read the table without loading a format's heavy library: a writer that needs one
(GLB: trimesh) imports it when it runs.
"""

from __future__ import annotations

import importlib
from enum import Enum
from pathlib import Path

from stream_recon.app.outputs.atomic_writes import OutputPathError, file_to_write, is_staging
from stream_recon.app.outputs.export_job import ExportError, FormatSpec

FOLDER = Path(__file__).parent


def names() -> tuple[str, ...]:
    """The formats' names: the folder's files, in name order."""
    return tuple(sorted(path.stem for path in FOLDER.glob("*.py") if not path.stem.startswith("_")))


def _specs() -> list[FormatSpec]:
    specs = []
    for name in names():
        spec = importlib.import_module(f".{name}", __name__).SPEC
        if spec.name != name:
            raise ImportError(f"app/outputs/formats/{name}.py holds the spec of {spec.name!r}: a file's spec is "
                              f"named after the file ({name!r})")
        specs.append(spec)
    return sorted(specs, key=lambda spec: spec.listed)


class _Format(str, Enum):
    """A format as `--format` takes it: the member is its name (a str, as typer and run.json read it) and
    carries its FormatSpec."""

    spec: FormatSpec

    def __new__(cls, spec: FormatSpec) -> _Format:
        member = str.__new__(cls, spec.name)
        member._value_ = spec.name
        member.spec = spec
        return member

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

    def file_target(self, path: Path, overwrite: bool) -> Path:
        """The file a file format's export at `path` is written to: an existing folder gets the default name
        inside it (never a folder that holds a folder format's export: mixed with it, the file would keep
        --overwrite from replacing it); a name without a suffix gets the format's (scene -> scene.glb); a name
        with another suffix is refused, so a GLB is never named .ply; a symlink is written through to its
        target; a FIFO, a device or a socket is refused, never replaced; an existing file only with overwrite."""
        if path.is_dir():
            holder = folder_export_in({entry.name for entry in path.iterdir() if not is_staging(entry)})
            if holder is not None:  # written into it, the file would keep --overwrite from replacing that export
                raise ExportError(f"{path} holds a {holder.label} export, which a {self.label} file is not written "
                                  f"into; name the file (-o {path.with_name(path.name + self.suffix)}) or choose "
                                  "another folder")
            path = path / self.spec.default_name
        try:
            path = file_to_write(path)  # a symlink's target, which is what gets written
        except OutputPathError as error:
            raise ExportError(str(error)) from None
        if path.suffix and not self.accepts_suffix(path.suffix):
            owner = next((other for other in ExportFormat if other.accepts_suffix(path.suffix)), None)
            whose = f", the {owner.label} format's suffix," if owner else ""
            instead = f", or use --format {owner.value}" if owner else ""
            raise ExportError(
                f"--output {path} ends in {path.suffix}{whose} but --format {self.value} writes a {self.label} file: "
                f"name it {path.with_suffix(self.suffix).name}{instead}"
            )
        if not path.suffix and not path.exists():  # a new name: the format's suffix is added
            path = path.with_name(path.name + self.suffix)
        if path.exists() and not overwrite:
            raise ExportError(f"{path} already exists; pass --overwrite to replace it, or choose another --output")
        return path

    def folder_target(self, path: Path, overwrite: bool) -> tuple[Path, list[Path]]:
        """The folder a folder format's export at `path` goes to (a new or empty folder, or with overwrite one
        that holds an earlier export of the format and nothing else) and the entries of that earlier export."""
        if path.is_symlink():
            path = path.resolve()
        if path.exists() and not path.is_dir():
            raise ExportError(f"{self.label} export goes to a directory, but {path} is a file; choose another --output")
        # (the hidden folders of an export in progress, or killed part-way, are ours, not the user's)
        entries = sorted(entry for entry in path.iterdir() if not is_staging(entry)) if path.is_dir() else []
        others = [entry for entry in entries if entry.name not in self.spec.folder_contents]
        if others:
            raise ExportError(
                f"{path} is not empty ({len(entries)} entries such as {others[0].name}): a {self.label} export "
                f"writes {' and '.join(self.spec.folder_contents)} into its folder and would mix them with other "
                "files; choose a new or empty --output"
            )
        if entries and not overwrite:
            raise ExportError(
                f"{path} already holds a {self.label} export; pass --overwrite to replace it, or choose another --output"
            )
        return path, entries


# The formats `--format` takes, a member each (named as its file, in upper case), made from the folder.
ExportFormat = _Format("ExportFormat", [(spec.name.upper(), spec) for spec in _specs()], module=__name__,
                       qualname="ExportFormat")


def folder_export_in(entries: set[str]) -> ExportFormat | None:
    """The folder format whose export a folder of these entries (names, hidden ones left out) holds, or None."""
    return next((fmt for fmt in ExportFormat if fmt.is_folder and fmt.spec.folder_marker in entries
                 and entries <= set(fmt.spec.folder_contents)), None)


def format_summary() -> str:
    """'PLY, GLB, COLMAP, TUM, nerfstudio or Gaussian splats': every format, for help texts."""
    labels = [fmt.label for fmt in ExportFormat]
    return f"{', '.join(labels[:-1])} or {labels[-1]}"


def own_caps() -> str:
    """'500000 for splats': the formats with a cap of their own on points, for --max-points' help."""
    return ", ".join(f"{fmt.spec.max_points} for {fmt.value}" for fmt in ExportFormat if fmt.spec.max_points)
