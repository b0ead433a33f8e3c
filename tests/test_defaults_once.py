"""Each default of a run is stated once, by the module that owns it, and read everywhere else.

The test reads app/, models/ and cache/ as syntax trees and looks for each default's value where a name of
its idea is given a value: an assignment, a dataclass field, a parameter's default, a keyword argument,
a dict entry, a fallback (`x or VALUE`, `VALUE if x is None else x`), and a help text's `[default: VALUE]`.
A value the idea's owner does not state is a second copy, and the test names its line. The same number
used for another idea is allowed only where ALLOWED says why.
"""

from __future__ import annotations

import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("app", "models", "cache")


@dataclass(frozen=True)
class Default:
    idea: str
    value: object
    names: str  # a regular expression over the names a value of this idea is given; "" for any name
    owner: str  # the one file that states the value


DEFAULTS = (
    Default("the confidence that keeps a pixel's depth", 2.0, r"conf", "models/stream/prediction.py"),
    Default("the viewer's host", "127.0.0.1", "", "app/options.py"),
    Default("the viewer's host", "localhost", "", "app/options.py"),
    Default("the viewer's port", 8080, "", "app/options.py"),
    Default("the chunk length", 320, r"chunk|views|cached_frames", "models/stream/stream_config.py"),
    Default("the scale frames", 8, r"scale_frames|^scale$", "models/stream/stream_config.py"),
    Default("the window", 64, r"window", "models/stream/stream_config.py"),
    Default("the input width", 518, r"width|img_size|image_size", "app/sources/input_size.py"),
    Default("eval's --max-diff", 0.01, r"max_diff", "app/evaluation/settings.py"),
    Default("eval's --depth-max-diff", 0.02, r"max_diff", "app/evaluation/settings.py"),
)

# (file, the name given the value): why that value there is another idea's
ALLOWED = {
    ("models/network/config.py", "img_size"):
        "the size of DINO's trained positional table, a property of the checkpoint, not the app's input width",
    ("app/evaluation/batch.py", "_node_ip_address"):
        "the address Ray's head node runs on for a local cluster, not the viewer's",
}


def bindings(tree: ast.AST) -> list[tuple[str, ast.Constant]]:
    """(name, constant) for every place a constant is given to a name in `tree`."""
    found: list[tuple[str, ast.Constant]] = []

    def add(name: str | None, node: ast.AST | None) -> None:
        if name is not None and isinstance(node, ast.Constant):
            found.append((name, node))

    def name_of(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute):
            return node.attr
        return None

    def first_name(node: ast.AST) -> str | None:
        return next((name_of(child) for child in ast.walk(node) if name_of(child)), None)

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                add(name_of(target), node.value)
        elif isinstance(node, ast.AnnAssign):
            add(name_of(node.target), node.value)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            positional = [*node.args.posonlyargs, *node.args.args]
            for arg, default in zip(positional[len(positional) - len(node.args.defaults):], node.args.defaults,
                                    strict=True):
                add(arg.arg, default)
            for arg, default in zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True):
                add(arg.arg, default)
        elif isinstance(node, ast.Call):
            for keyword in node.keywords:
                add(keyword.arg, keyword.value)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    add(key.value, value)
        elif isinstance(node, ast.BoolOp):  # `host or "127.0.0.1"`
            name = first_name(node)
            for value in node.values:
                add(name, value)
        elif isinstance(node, ast.IfExp):  # `8080 if port is None else port`
            name = first_name(node.test)
            add(name, node.body)
            add(name, node.orelse)
    return found


def help_texts(tree: ast.AST) -> list[ast.Constant]:
    """String constants that show a default, as typer's help does: `[default: ...]`."""
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "[default:" in node.value]


def same(value: object, default: object) -> bool:
    if isinstance(value, bool) or type(value) is not type(default) and not (
            isinstance(value, (int, float)) and isinstance(default, (int, float))):
        return False
    return value == default


def second_copies() -> list[str]:
    problems = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(), filename=relative)
            for name, constant in bindings(tree):
                for default in DEFAULTS:
                    if relative == default.owner or not same(constant.value, default.value):
                        continue
                    if default.names and not re.search(default.names, name, re.IGNORECASE):
                        continue
                    if (relative, name) in ALLOWED:
                        continue
                    problems.append(f"{relative}:{constant.lineno}: {name} = {constant.value!r} states "
                                    f"{default.idea}, which {default.owner} owns: read it from there")
            for constant in help_texts(tree):
                for default in DEFAULTS:
                    if re.search(rf"\[default: {re.escape(str(default.value))}\]", constant.value):
                        problems.append(f"{relative}:{constant.lineno}: a help text writes {default.idea} "
                                        f"({default.value!r}) by hand: format it from {default.owner}'s value")
    return problems


def test_every_default_is_stated_by_its_owner_only() -> None:
    problems = second_copies()
    assert not problems, "\n".join(problems)


def test_each_owner_states_its_defaults() -> None:
    # the owners above are where the values are: a default that moves takes its owner's line here along
    for idea, owner in {(default.idea, default.owner) for default in DEFAULTS}:
        stated = [constant.value for _, constant in bindings(ast.parse((ROOT / owner).read_text()))]
        values = [default.value for default in DEFAULTS if default.idea == idea]
        assert any(same(value, default) for value in stated for default in values), (idea, owner)


def test_the_scan_sees_a_second_copy(tmp_path: Path, monkeypatch) -> None:
    # the forms a copy takes: a field, a parameter's default, a fallback and a help text
    package = tmp_path / "app"
    package.mkdir()
    (package / "copy.py").write_text(
        "from dataclasses import dataclass\n"
        "@dataclass\n"
        "class Shape:\n"
        "    window: int = 64\n"
        "def serve(host='127.0.0.1', port=None):\n"
        "    port = 8080 if port is None else port\n"
        "HELP = 'seconds \\\\[default: 0.01]'\n"
        "maxsize = 64  # another idea's 64: not a window\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    problems = second_copies()
    assert sorted(int(problem.split(":")[1]) for problem in problems) == [4, 5, 6, 7], problems
