"""The wheel, installed alone: built from this checkout and installed into a fresh venv that
sees nothing of the repository, it runs `-h`, `info` and a `--config indoor` run of the bundled sample.

Rather than download torch and the rest a second time, the fresh venv sees the installed
distributions that the wheel's own requirements name, and theirs, recursively: symlinks in one
folder that a .pth file adds to its path. Nothing else is visible, so a module that imports a
package the wheel does not declare fails here as it would for a user.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
SAMPLE_FRAMES = 14


def run(command: list[str | Path], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=600, **kwargs)
    assert result.returncode == 0, f"{command} exited {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`python -m build`: the sdist, then the wheel from the sdist (so the sdist is complete too)."""
    dist = tmp_path_factory.mktemp("dist")
    # --no-isolation: the dev extra's setuptools builds it, no index needed
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, REPO])
    (built,) = dist.glob("*.whl")
    return built


def wheel_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        (metadata_name,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        fields = Parser().parsestr(archive.read(metadata_name).decode())
    return fields.get_all("Requires-Dist") or []


def requirement_closure(requirements: list[str]) -> list[metadata.Distribution]:
    """The installed distributions these requirements need on this interpreter, and theirs, recursively."""
    found: dict[str, metadata.Distribution] = {}
    expanded: set[tuple[str, str]] = set()  # (distribution, extra) pairs whose requirements are queued
    pending = [(Requirement(text), "") for text in requirements]
    while pending:
        requirement, parent_extra = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": parent_extra}):
            continue
        name = canonicalize_name(requirement.name)
        found[name] = distribution = metadata.distribution(requirement.name)
        for extra in ("", *requirement.extras):
            if (name, extra) not in expanded:
                expanded.add((name, extra))
                pending += [(Requirement(text), extra) for text in distribution.requires or []]
    return list(found.values())


def link_distributions(distributions: list[metadata.Distribution], folder: Path) -> None:
    """Symlink each distribution's top-level entries (packages, modules, its .dist-info) into folder."""
    folder.mkdir()
    for distribution in distributions:
        assert distribution.files is not None, f"{distribution.metadata['Name']} has no RECORD to link from"
        root = Path(distribution.locate_file(""))
        for entry in {Path(file).parts[0] for file in distribution.files}:
            # scripts sit outside site-packages (..); a .pth only works in a site directory
            if entry in ("..", "__pycache__") or entry.endswith(".pth") or (folder / entry).exists():
                continue
            (folder / entry).symlink_to(root / entry)


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel, its requirements linked in; returns its bin/ folder."""
    root = tmp_path_factory.mktemp("wheel-venv")
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site_packages = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]).stdout.strip())
    link_distributions(requirement_closure(wheel_requirements(wheel)), root / "requirements")
    (site_packages / "wheel_requirements.pth").write_text(f"{root / 'requirements'}\n")

    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel])
    run([sys.executable, "-m", "pip", "--python", python, "check"])
    return venv / "bin"


@pytest.fixture
def outside_the_checkout(tmp_path: Path) -> dict[str, str]:
    """Run from an empty folder with no PYTHONPATH and no reachable or cached checkpoints."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), STREAM_RECON_CHECKPOINTS=str(tmp_path / "none"),
               OMP_NUM_THREADS="1")
    return {"cwd": str(tmp_path), "env": env}


def test_the_wheel_carries_the_presets_and_the_sample_and_no_tests(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())

    assert {f"stream_recon/configs/{preset}.yaml" for preset in ("indoor", "outdoor", "low-memory")} <= names
    assert sum(name.startswith("stream_recon/app/sample/") for name in names) == SAMPLE_FRAMES
    assert "stream_recon/app/cli.py" in names and "stream_recon/cache/__init__.py" in names
    assert not any(name.startswith(("tests/", "scripts/")) for name in names)


def test_the_installed_wheel_imports_from_its_venv_only(installed: Path, outside_the_checkout: dict) -> None:
    where = run([installed / "python", "-c", "import stream_recon.app as a, stream_recon.configs as c; "
                 "print(a.__file__); print(c.__file__)"], **outside_the_checkout).stdout.split()

    assert all(Path(path).is_relative_to(installed.parent) for path in where), where


def wheel_version(bin_dir: Path) -> str:
    (dist_info,) = bin_dir.parent.glob("lib/python*/site-packages/stream_recon-*.dist-info")
    return dist_info.name.removeprefix("stream_recon-").removesuffix(".dist-info")


def test_help_and_info_from_the_wheel(installed: Path, outside_the_checkout: dict) -> None:
    shown = run([installed / "stream-recon", "-h"], **outside_the_checkout).stdout
    assert "run" in shown and "info" in shown

    info = json.loads(run([installed / "stream-recon", "info", "--json"], **outside_the_checkout).stdout)
    assert info["packages"]["stream-recon"] == wheel_version(installed)
    assert info["packages"]["torch"] == torch.__version__


def test_a_preset_run_of_the_bundled_sample_from_the_wheel(
    installed: Path, tiny_checkpoint: Path, outside_the_checkout: dict
) -> None:
    result = run([installed / "stream-recon", "--config", "indoor", "--checkpoint", tiny_checkpoint,
                  "--device", "cpu", "--no-viewer"], **outside_the_checkout)

    assert "bundled sample" in result.stderr and "done: 14 frames" in result.stderr
    record = json.loads((Path(outside_the_checkout["cwd"]) / "outputs" / "sample" / "run.json").read_text())
    assert record["status"] == "complete" and record["summary"]["frames"] == SAMPLE_FRAMES
    assert record["settings"]["keyframes"] == "flow"  # from configs/indoor.yaml, read out of the wheel
