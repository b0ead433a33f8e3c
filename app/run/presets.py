"""Run presets: YAML files of RunOptions fields (configs/indoor.yaml, ...), overridden by CLI flags.

    # configs/low-memory.yaml
    image_width: 392
    window: 32
    keyframes: interval:2

`--config low-memory` finds configs/low-memory.yaml; `--config path/to/mine.yaml` reads that file.
The named presets are the package data of stream_recon.configs (configs/ in the repository), read
through importlib.resources so that a wheel finds them as well as a checkout.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from stream_recon.app.options import OptionsError, PresetError, RunOptions, current_names

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

PRESET_DIR = resources.files("stream_recon.configs")


def available_presets() -> list[str]:
    presets = (path for path in PRESET_DIR.iterdir() if path.name.endswith(".yaml") and _is_run_preset(path))
    return sorted(path.name.removesuffix(".yaml") for path in presets)


def _is_run_preset(path: Traversable) -> bool:
    # configs/ also holds model presets; a run preset is a mapping of RunOptions fields only
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(data, dict) and set(data) <= set(RunOptions.field_names())


def find_preset(name_or_path: str) -> Path | Traversable:
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    named = PRESET_DIR.joinpath(f"{name_or_path}.yaml")
    if "/" not in name_or_path and named.is_file():
        return named
    known = ", ".join(available_presets()) or "none found"
    raise PresetError(f"no preset {name_or_path!r}: give a YAML file or one of the presets ({known})")


def load_preset(name_or_path: str) -> dict[str, Any]:
    """The options a preset sets, checked against RunOptions' fields."""
    path = find_preset(name_or_path)
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise PresetError(f"preset {path} is not valid YAML: {_yaml_problem(error)}") from None
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or "it is not text"
        raise PresetError(f"cannot read the preset {path}: {reason}; check the file, or pass another --config") from None
    if not isinstance(data, dict):
        raise PresetError(f"preset {path} must be a mapping of option: value, got {type(data).__name__}")
    data = current_names(data)
    unknown = sorted(set(data) - set(RunOptions.field_names()))
    if unknown:
        raise PresetError(
            f"preset {path} sets unknown option(s) {', '.join(unknown)}; "
            f"known options: {', '.join(RunOptions.field_names())}"
        )
    return data


def _yaml_problem(error: yaml.YAMLError) -> str:
    """The parser's complaint on one line: where (line, column) and what, without its quoted context."""
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"{where}{problem}"


def build_options(
    preset: str | None, overrides: dict[str, Any], defaults: dict[str, Any] | None = None
) -> RunOptions:
    """RunOptions from defaults < preset < flags the user gave (None means "not given").

    defaults: the caller's own defaults over RunOptions' (the bundled sample's), still below the preset.
    """
    values = dict(defaults or {})
    values.update(load_preset(preset) if preset else {})
    values.update({key: value for key, value in overrides.items() if value is not None})
    try:
        return RunOptions(**values)
    except TypeError as error:  # a value of the wrong kind, e.g. a list for window
        raise OptionsError(f"invalid options: {error}") from None
