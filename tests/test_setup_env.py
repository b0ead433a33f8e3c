"""scripts/setup-env picks what to install for the machine: where `nvidia-smi` lists a GPU, the `cuda` extra
(FlashInfer) and FlashInfer's kernels built once; elsewhere nothing more. The script runs as it is, from a copy
of the checkout's layout; pip and the kernel build, which need the network and a GPU, are a shim's that writes
down what it was asked."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SHIM = """#!/usr/bin/env bash
# the checkout's .venv/bin/python, standing in: torch is there; pip and the kernel build write what was asked
echo "$*" >> "{log}"
case "$*" in
  *"-m pip"*) exit 0 ;;
  *find_spec*) exit 0 ;;
  *"from importlib.metadata import version"*) echo 2.11.0 ;;
  *flashinfer.build_kernels*) echo "built" ;;
esac
exit 0
"""


def executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def set_up(tmp_path: Path, gpu: bool, extras: str = "") -> list[str]:
    """setup-env run in a copy of the checkout's layout; the lines its python was asked to run."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup-env", checkout / "scripts" / "setup-env")
    shutil.copy(REPO / "pyproject.toml", checkout / "pyproject.toml")
    log = tmp_path / "asked.log"
    (checkout / ".venv" / "bin").mkdir(parents=True)
    executable(checkout / ".venv" / "bin" / "python", SHIM.format(log=log))
    tools = tmp_path / "tools"
    tools.mkdir()
    if gpu:
        executable(tools / "nvidia-smi", "#!/usr/bin/env bash\necho 'GPU 0: NVIDIA H200 (UUID: GPU-0)'\n")
    path = os.pathsep.join([str(tools), *(p for p in os.environ["PATH"].split(os.pathsep)
                                          if not (Path(p) / "nvidia-smi").exists())])
    done = subprocess.run([str(checkout / "scripts" / "setup-env"), *([extras] if extras else [])],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": path})
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines()


@pytest.mark.parametrize("extras", ["", "dev"])
def test_a_gpu_machine_gets_flashinfer_and_its_kernels_built_once(tmp_path: Path, extras: str) -> None:
    asked = set_up(tmp_path, gpu=True, extras=extras)
    installs = [line for line in asked if "-m pip install" in line and "-e" in line]
    wanted = "cuda" if not extras else f"{extras},cuda"
    assert len(installs) == 1 and installs[0].endswith(f"checkout[{wanted}]"), asked
    assert sum("flashinfer.build_kernels" in line for line in asked) == 1


def test_a_cpu_machine_gets_nothing_more(tmp_path: Path) -> None:
    asked = set_up(tmp_path, gpu=False)
    installs = [line for line in asked if "-m pip install" in line and "-e" in line]
    assert len(installs) == 1 and installs[0].endswith("checkout"), asked
    assert not any("flashinfer" in line for line in asked)


def test_a_second_call_on_a_gpu_machine_is_current(tmp_path: Path) -> None:
    first = set_up(tmp_path, gpu=True)
    log = tmp_path / "asked.log"
    log.write_text("")
    checkout = tmp_path / "checkout"
    tools = tmp_path / "tools"
    path = os.pathsep.join([str(tools), os.environ["PATH"]])
    done = subprocess.run([str(checkout / "scripts" / "setup-env")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": path})
    assert done.returncode == 0 and first and log.read_text() == "", done.stderr
