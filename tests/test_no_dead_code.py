"""No product definition lives for the tests alone: every function, method and class of app/, models/ and
cache/ is used by the product itself or by the tools in scripts/.

Read with `ast`, by name, without importing anything: a definition is used where its name appears in
another module's or its own code (a name, an attribute, an import, a keyword argument) or in a string
(an import by a string: a child's "serve", a "module:function"; a docstring's mention is none), or in a
script's text (the shell scripts
among them). Names are not resolved, so a method is used where any object's attribute of that name is:
the check errs towards "used", never towards "dead". A definition only tests use belongs in tests/.
What the language or a library calls by its own rule (dunder methods, a torch module's `extra_repr`, a
function `atexit` registers, a keyframe policy the table finds by its file) is not asked to be named.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("app", "models", "cache")
# Definitions something outside our code calls by its own rule, and why.
CALLED_BY_THEIR_RULE = {
    "extra_repr": "torch's Module.__repr__ calls it",
}
# Folders whose files a table finds without naming what they define.
FOUND_BY_A_TABLE = {
    "models/stream/keyframes": "a keyframe policy's class: keyframes/__init__.py finds it in its file",
}
REGISTERING_DECORATORS = {"atexit.register"}
WORD = re.compile(r"[A-Za-z_]\w*")


def python_files(root: Path, folders: Iterable[str]) -> list[Path]:
    return sorted(path for folder in folders for path in (root / folder).rglob("*.py"))


def definitions(path: Path) -> Iterable[tuple[str, int]]:
    """(name, line) of every function, method and class `path` defines, but what is called by its own rule."""
    return definitions_in(path.read_text())


@cache
def definitions_in(source: str) -> tuple[tuple[str, int], ...]:
    """definitions of a module's source (by its text: the copies the check's own test reads parse once)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.name.startswith("__") or node.name in CALLED_BY_THEIR_RULE:
            continue
        if any(ast.unparse(decorator) in REGISTERING_DECORATORS for decorator in node.decorator_list):
            continue
        found.append((node.name, node.lineno))
    return tuple(found)


def names_used(paths: Iterable[Path]) -> set[str]:
    """Every name the code of `paths` reads, imports or passes, and every word of its strings (but its
    docstrings: a name a docstring mentions is not used by it)."""
    return set().union(*(names_used_in(path.read_text()) for path in paths))


@cache
def names_used_in(source: str) -> frozenset[str]:
    """names_used of one module's source (by its text: each module parses once in the session; the check's own
    test reads copies of all of them, one changed)."""
    used: set[str] = set()
    tree = ast.parse(source)
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}  # docstrings: no use
    for node in ast.walk(tree):
        if id(node) in prose:
            continue
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.alias):
            used.add(node.name.rpartition(".")[2])
        elif isinstance(node, ast.keyword) and node.arg:
            used.add(node.arg)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            used.update(WORD.findall(node.value))
    return frozenset(used)


def tools_text(root: Path) -> set[str]:
    """The words of the scripts that are not Python (scripts/setup-env, the device suites)."""
    return {word for path in (root / "scripts").rglob("*") if path.is_file() and path.suffix != ".py"
            for word in WORD.findall(path.read_text(errors="replace"))}


def unused_definitions(root: Path = ROOT) -> list[str]:
    """'path:line: name' for each product definition neither the product nor scripts/ uses."""
    used = names_used(python_files(root, PRODUCT)) | names_used(python_files(root, ["scripts"])) | tools_text(root)
    found = []
    for path in python_files(root, PRODUCT):
        where = path.relative_to(root).as_posix()
        if any(where.startswith(f"{folder}/") for folder in FOUND_BY_A_TABLE):
            continue
        found += [f"{where}:{line}: {name}" for name, line in definitions(path) if name not in used]
    return found


def test_every_product_definition_is_used_by_the_product_or_its_tools() -> None:
    unused = unused_definitions()
    assert not unused, ("product definitions only tests use (or nothing does): remove them, or move them into "
                        "tests/\n" + "\n".join(unused))


@pytest.mark.parametrize("added", [
    "def reference_resize(image):\n    return image\n",
    "class TimingProbe:\n    pass\n",
])
def test_a_definition_only_a_test_uses_is_caught(tmp_path: Path, added: str) -> None:
    """The check itself: a definition added to a real module, used by a test alone, is named."""
    for folder in (*PRODUCT, "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                copy = tmp_path / path.relative_to(ROOT)
                copy.parent.mkdir(parents=True, exist_ok=True)
                copy.write_bytes(path.read_bytes())
    module = tmp_path / "app" / "sources" / "preprocess.py"
    module.write_text(f"{module.read_text()}\n\n{added}")
    (tmp_path / "tests").mkdir()
    name = WORD.findall(added)[1]
    (tmp_path / "tests" / "test_it.py").write_text(f"from stream_recon.app.sources.preprocess import {name}\n")
    found = unused_definitions(tmp_path)
    assert len(found) == 1 and found[0].startswith("app/sources/preprocess.py:") and found[0].endswith(name), found
