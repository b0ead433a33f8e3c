"""The run directory is read and written only through app/outputs/rundir.py (docs/ARCHITECTURE.md, "app inside"),
one npz only through app/outputs/npz_reading.py.

The test reads every module of app/ but those two as a syntax tree and refuses a call that opens a file
(open, Path.open, read_text, write_text, np.load, np.savez, ...) whose path names a run file: one of
rundir's names (RUN_JSON, TRAJECTORY_TUM, PREDICTIONS_DIR, ...) or the file's name as a string. A per-frame
npz is opened by a path from rundir.prediction_files, so np.load is refused outside npz_reading.py wherever it is.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

OPENING_FUNCTIONS = {"open", "read_text", "read_bytes", "write_text", "write_bytes", "load", "loads", "loadtxt",
                     "savez", "savez_compressed", "save", "read"}
RUN_FILE_NAMES = re.compile(
    r"\b(RUN_JSON|TRAJECTORY_TUM|TRAJECTORY_OPEN_TUM|POINTS_PLY|EVAL_JSON|PREDICTIONS_DIR|BATCH_MARKER|"
    r"COMPLETE_MARKER)\b|run\.json|trajectory_(open_)?tum\.txt|points\.ply|eval\.json|predictions/|\.complete\b"
)
# The modules that open a run's files themselves: the run directory's, and the one that reads an npz
RUN_DIR_MODULES = {"app/outputs/rundir.py", "app/outputs/npz_reading.py"}
# (module, function called): why that module opens a run file itself
ALLOWED: dict[tuple[str, str], str] = {}


def _called_name(call: ast.Call) -> str | None:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return None


def run_files_opened(root: Path = ROOT) -> list[str]:
    problems = []
    for path in sorted((root / "app").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative in RUN_DIR_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=relative)):
            if not isinstance(node, ast.Call):
                continue
            name = _called_name(node)
            if name not in OPENING_FUNCTIONS or (relative, name) in ALLOWED:
                continue
            text = ast.unparse(node)
            if text.startswith(("np.load(", "numpy.load(")) or RUN_FILE_NAMES.search(text):
                problems.append(f"{relative}:{node.lineno}: {text[:100]} opens a run file itself: read and write it "
                                "through app/outputs/rundir.py (add a small function there if it has none)")
    return problems


def test_only_rundir_opens_run_files() -> None:
    problems = run_files_opened()
    assert not problems, "\n".join(problems)


def test_the_scan_sees_a_run_file_opened(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "reader.py").write_text(
        "import json\n"
        "import numpy as np\n"
        "def settings(run_dir):\n"
        "    return json.loads((run_dir / RUN_JSON).read_text())\n"
        "def depth(path):\n"
        "    with np.load(path) as data:\n"
        "        return data['depth']\n"
        "def trajectory(run_dir):\n"
        "    return open(run_dir / 'trajectory_tum.txt').read()\n"
        "def preset(path):\n"
        "    return path.read_text()  # not a run file\n"
    )
    lines = sorted(int(problem.split(":")[1]) for problem in run_files_opened(tmp_path))
    assert lines == [4, 4, 6, 9, 9], lines  # json.loads and read_text; np.load; open and .read() of it


if __name__ == "__main__":
    print("\n".join(run_files_opened()) or "none", file=sys.stderr)
