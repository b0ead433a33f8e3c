"""The rules docs/ARCHITECTURE.md states that no other test file checks, read from the sources with `ast`
(nothing is imported). Its section "Rules and their tests" lists every rule with the test that guards it.

Each check is a function over a list of files, so that a test beside it can hand it a copy of a real module
with one violating line added and see that line named.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers import parsed_source

ROOT = Path(__file__).resolve().parents[1]


def python_files(*folders: str, root: Path | None = None) -> list[Path]:
    base = root or ROOT
    return sorted(path for folder in folders for path in (base / folder).rglob("*.py"))


def relative(path: Path, root: Path | None = None) -> str:
    return path.relative_to(root or ROOT).as_posix()


def identifiers(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, name) for every name the code gives or reads: variables, attributes, arguments, keywords,
    functions and classes."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.keyword) and node.arg:
            yield node.value.lineno, node.arg


def words(name: str) -> list[str]:
    """`keyframe_policy` -> [keyframe, policy]; `FramePrediction` -> [frame, prediction]."""
    return [word.lower() for word in re.findall(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])", name)]


def top_level_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports that run when the module is imported: its body's, and those in its top-level `if` and
    `try` blocks, but not under `if TYPE_CHECKING`."""
    def visit(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                yield from visit(node.body)
                yield from visit(node.orelse)
            elif isinstance(node, ast.Try):
                for block in (node.body, *(handler.body for handler in node.handlers), node.orelse, node.finalbody):
                    yield from visit(block)

    yield from visit(tree.body)


# -- the cache never knows what a frame is (to it, a group of tokens), a pose or a keyframe policy ---------
# The words of the stream's ideas: a frame's content and what the model predicts of it, the policy that keeps
# frames, the engine and the chunks. The cache counts frames and tokens, and names none of these.
STREAM_WORDS = {"pose", "poses", "keyframe", "keyframes", "policy", "policies", "image", "images", "depth",
                "intrinsics", "camera", "prediction", "predictions", "pixel", "pixels", "rgb", "engine", "flow"}


def stream_ideas_in_the_cache(paths: list[Path], root: Path | None = None) -> list[str]:
    found = []
    for path in paths:
        for line, name in identifiers(parsed_source(path)):
            named = STREAM_WORDS.intersection(words(name))
            if named:
                found.append(f"{relative(path, root)}:{line}: {name} (the cache knows nothing of {', '.join(named)})")
    return found


def test_the_cache_names_no_frame_content_pose_or_keyframe_policy() -> None:
    assert stream_ideas_in_the_cache(python_files("cache")) == []


# -- the app never reaches into the models' or the cache's internals -------------------------------------
def private_names_of_the_rooms(root: Path | None = None) -> set[str]:
    """The underscore names models/ and cache/ define (functions, classes, module names, attributes set on
    self), less those app/ defines itself."""
    def defined(folders: tuple[str, ...]) -> set[str]:
        names = set()
        for path in python_files(*folders, root=root):
            for node in ast.walk(parsed_source(path)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    names.add(node.id)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
        return {name for name in names if name.startswith("_") and not name.startswith("__")}

    return defined(("models", "cache")) - defined(("app",))


def app_reaching_into_internals(paths: list[Path], root: Path | None = None) -> list[str]:
    private = private_names_of_the_rooms(root)
    found = []
    for path in paths:
        for node in ast.walk(parsed_source(path)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("stream_recon.models",
                                                                                    "stream_recon.cache")):
                found += [f"{relative(path, root)}:{node.lineno}: imports {alias.name} from {node.module}"
                          for alias in node.names if alias.name.startswith("_")]
            elif isinstance(node, ast.Attribute) and node.attr in private:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    found.append(f"{relative(path, root)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_app_uses_no_private_name_of_the_models_or_the_cache() -> None:
    assert app_reaching_into_internals(python_files("app")) == []


# -- a command module imports at its top only what its flags need -----------------------------------------
# What the modules that `-h` loads may import at their top besides the standard library and the package's
# own light modules: typer and rich draw the help; numpy is the type of the npz schema's and the prediction's
# arrays (light: the help check, tests/test_app_cli.py, allows it); plyfile is one pure-Python module (under
# 1 ms to import), which the export formats' files (the table `export -h` reads) import for their PLY files.
COMMAND_TOP_LIBRARIES = {"typer", "rich", "click", "numpy", "plyfile"}


def module_path(dotted: str, root: Path) -> Path | None:
    """stream_recon.app.options -> app/options.py (None for what is not a module of the package)."""
    parts = dotted.split(".")[1:]
    if not parts:
        return None
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def imported_at_top(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted module) for what `path` imports when it is imported, relative imports resolved."""
    parts = path.relative_to(root).with_suffix("").parts
    package = ["stream_recon", *(parts[:-1])]
    for node in top_level_imports(parsed_source(path)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
            continue
        if node.module == "__future__":
            continue
        module = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).rstrip(".") \
            if node.level else node.module or ""
        yield node.lineno, module
        for alias in node.names:  # `from stream_recon.app import options` imports the module options too
            if module.startswith("stream_recon") and module_path(f"{module}.{alias.name}", root):
                yield node.lineno, f"{module}.{alias.name}"


def heavy_imports_of_the_commands(root: Path | None = None) -> list[str]:
    """Each library outside COMMAND_TOP_LIBRARIES that a module reached from app/cli.py and app/commands/*
    imports at its top, with the chain of top-level imports that reaches it."""
    root = root or ROOT
    starts = [root / "app" / "cli.py", *sorted((root / "app" / "commands").glob("*.py"))]
    chains = {path: relative(path, root) for path in starts}
    todo = list(starts)
    found = []
    while todo:
        path = todo.pop()
        for line, module in imported_at_top(path, root):
            top = module.split(".")[0]
            if top == "stream_recon":
                dotted = module.split(".")
                for end in range(2, len(dotted) + 1):  # the packages on the way are imported too
                    reached = module_path(".".join(dotted[:end]), root)
                    if reached is not None and reached not in chains:
                        chains[reached] = f"{chains[path]} -> {relative(reached, root)}"
                        todo.append(reached)
            elif top not in sys.stdlib_module_names and top not in COMMAND_TOP_LIBRARIES:
                found.append(f"{chains[path]}:{line}: import {module}")
    return sorted(found)


def test_command_modules_reach_no_heavy_library_at_their_top() -> None:
    assert heavy_imports_of_the_commands() == []


def test_the_app_packages_hold_no_code() -> None:
    """app/__init__.py and its rooms' (commands, sources, run, outputs, evaluation): a docstring at most, which
    says what the room holds; the app's modules are imported by their names. (viewer/__init__.py holds the
    LiveViewer, the one object the rest of the app holds.)"""
    packages = [ROOT / "app" / "__init__.py", *(ROOT / "app" / room / "__init__.py"
                                                for room in ("commands", "sources", "run", "outputs", "evaluation"))]
    holding_code = [relative(path) for path in packages
                    if any(not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
                           for node in parsed_source(path).body)]
    assert holding_code == []


# -- every file a run, an export, an evaluation or a batch writes goes through atomic_writes.atomic_write ----
WRITING_METHODS = {"write_text", "write_bytes", "savez", "savez_compressed", "savetxt", "imwrite", "to_csv",
                   "mkstemp", "NamedTemporaryFile"}
# (module, what it calls): why that file is no output of a run and needs no atomic write
NOT_AN_OUTPUT = {
    ("models/builds/compile_child.py", "open"): "the compile child's log, which the child itself writes as it goes; "
                                           "the machine's, beside Inductor's cache, not a run's",
    ("models/builds/compile_child.py", "write_text"): "the lock naming the compiling child, the machine's, not a run's",
    ("app/outputs/output_folder.py", "open"): "the output folder opened read-only for its lock; nothing is written",
    ("app/outputs/rundir.py", "replace"): "an earlier run's predictions folder moved aside in one rename, not written",
}


def writes_a_file(call: ast.Call) -> str | None:
    """What the call writes with ('open', 'write_text', ...), or None when it writes no file."""
    func = call.func
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
    owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
    if name in WRITING_METHODS or (name in ("save", "dump") and owner in ("np", "numpy", "json", "pickle", "yaml")):
        return name
    if owner == "shutil" and name in ("copy", "copyfile", "copy2", "copytree", "move"):
        return name
    if name in ("replace", "rename") and (owner == "os" or (len(call.args) == 1 and not call.keywords)):
        return name  # a rename over a file: an atomic write of one's own
    if name == "open" and owner == "os":
        return name
    if name in ("open", "fdopen"):
        modes = [keyword.value for keyword in call.keywords if keyword.arg == "mode"]
        modes += call.args[1:2] if (name == "open" and not owner) or name == "fdopen" else call.args[:1]
        if any(isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+") for mode in modes):
            return name
    if name == "export" and (call.args or any(keyword.arg == "file_obj" for keyword in call.keywords)):
        return name  # trimesh writing to a path; export(file_type=...) returns the bytes
    return None


def files_written_past_atomic_write(paths: list[Path], root: Path | None = None) -> list[str]:
    found = []
    for path in paths:
        where = relative(path, root)
        if where == "app/outputs/atomic_writes.py":  # the atomic write itself
            continue
        tree = parsed_source(path)
        # what atomic_write is handed writes into its temporary file (np.savez(f, ...) in a lambda)
        handed = {id(inner) for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and getattr(node.func, "id", getattr(node.func, "attr", None)) == "atomic_write"
                  for argument in node.args[1:] for inner in ast.walk(argument)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and id(node) not in handed:
                how = writes_a_file(node)
                if how is not None and (where, how) not in NOT_AN_OUTPUT:
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:90]} "
                                 "(write it through atomic_writes.atomic_write)")
    return found


def test_every_output_file_is_written_through_atomic_write() -> None:
    assert files_written_past_atomic_write(python_files("app")) == []


# -- the backend table is read, never written again: the app names no backend -----------------------------
def backend_names(root: Path | None = None) -> set[str]:
    """The names of the backends: their rows' in cache/backends/, one file each, read from the files' syntax trees."""
    names = set()
    for path in sorted(((root or ROOT) / "cache" / "backends").glob("*.py")):
        tree = parsed_source(path)
        names |= {keyword.value.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and getattr(node.func, "id", None) == "BackendSpec" for keyword in node.keywords
                  if keyword.arg == "name"}
    return names


def backends_named_in_the_app(paths: list[Path], root: Path | None = None) -> list[str]:
    names = backend_names(root)
    return [f"{relative(path, root)}:{node.lineno}: {node.value!r} (ask models/attention_backends.py)"
            for path in paths for node in ast.walk(parsed_source(path))
            if isinstance(node, ast.Constant) and node.value in names]


def test_the_app_names_no_attention_backend() -> None:
    assert len(backend_names()) >= 3  # the scan reads the table
    assert backends_named_in_the_app(python_files("app")) == []


# -- a keyframe policy and an export format are named by their entry alone --------------------------------
KEYFRAME_POLICIES = "models/stream/keyframes"
EXPORT_FORMATS = "app/outputs/formats"


def keyframe_policies(root: Path | None = None) -> tuple[dict[str, str], set[str]]:
    """(each policy class -> its file, the words they are spelled with) of the files of models/stream/keyframes/,
    read from their syntax trees: a class is a policy where its body gives `word` a value."""
    classes, spelled = {}, set()
    for path in sorted(((root or ROOT) / KEYFRAME_POLICIES).glob("*.py")):
        for node in ast.walk(parsed_source(path)):
            if isinstance(node, ast.ClassDef):
                for statement in node.body:
                    if (isinstance(statement, ast.AnnAssign) and getattr(statement.target, "id", None) == "word"
                            and isinstance(statement.value, ast.Constant)):
                        classes[node.name] = relative(path, root)
                        spelled.add(statement.value.value)
    return classes, spelled


def export_format_members(root: Path | None = None) -> set[str]:
    """The members of ExportFormat: a format's file in app/outputs/formats/ makes one, named as the file in
    upper case."""
    return {path.stem.upper() for path in ((root or ROOT) / EXPORT_FORMATS).glob("*.py")
            if not path.stem.startswith("_")}


def entries_named_outside_their_table(paths: list[Path], root: Path | None = None) -> list[str]:
    """A policy's class anywhere but its own file, a comparison of a keyframe spelling or a policy with a
    policy's word outside the policies' folder, or a member of ExportFormat anywhere (the table makes them from
    the folder): a branch that adding a policy or a format would have to find."""
    classes, spelled = keyframe_policies(root)
    members = export_format_members(root)
    found = []
    for path in paths:
        where = relative(path, root)
        for node in ast.walk(parsed_source(path)):
            named = isinstance(node, (ast.Name, ast.Attribute)) and (node.id if isinstance(node, ast.Name)
                                                                         else node.attr)
            if named in classes and where != classes[named]:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (ask the policy, not its class)")
            elif not where.startswith(KEYFRAME_POLICIES) and isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                words = {side.value for side in sides if isinstance(side, ast.Constant)} & spelled
                if words and any(re.search(r"keyframes|policy|kind", ast.unparse(side)) for side in sides):
                    found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (ask the policy, not its name)")
            elif isinstance(node, ast.Attribute) and node.attr in members \
                    and getattr(node.value, "id", None) == "ExportFormat":
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (read the format's entry)")
    return found


def test_a_keyframe_policy_and_an_export_format_are_named_by_their_entry_alone() -> None:
    classes, spelled = keyframe_policies()
    assert len(classes) >= 3 and {"flow", "interval"} <= spelled and len(export_format_members()) >= 6
    assert entries_named_outside_their_table(python_files("app", "models")) == []


# -- what single modules of models/ never do, as their rows in the map say --------------------------------
# module: (what it never imports: a prefix of the dotted module, the rule)
NEVER_IMPORTS = {
    "models/loops/closer.py": (("threading", "queue", "concurrent", "multiprocessing", "asyncio"),
                               "the loop closer's core is synchronous: no threads, no queues"),
    "models/loops/process.py": (("threading", "concurrent", "asyncio"),
                                "the stream's side of loop closure has no threads"),
    "models/loops/corrections.py": (("torch", "scipy", "cv2", "gtsam"), "corrections are NumPy only"),
    "models/stream/chunks.py": (("stream_recon.models.network", "stream_recon.models.builds",
                                 "stream_recon.models.stream.engine", "stream_recon.models.stream.steps",
                                 "stream_recon.models.stream.graphs", "torch"),
                                "the chunk room's bookkeeping never runs the model"),
}


def imported_anywhere(path: Path, root: Path) -> Iterator[tuple[int, str]]:
    """(line, dotted module) for every import in `path`, in functions too, relative imports resolved."""
    parts = path.relative_to(root).with_suffix("").parts
    package = ["stream_recon", *(parts[:-1])]
    for node in ast.walk(parsed_source(path)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).rstrip(".") \
                if node.level else node.module or ""
            yield from ((node.lineno, f"{module}.{alias.name}") for alias in node.names)


def modules_importing_what_they_never_do(root: Path | None = None) -> list[str]:
    root = root or ROOT
    found = []
    for where, (never, rule) in NEVER_IMPORTS.items():
        for line, module in imported_anywhere(root / where, root):
            if any(module == prefix or module.startswith(f"{prefix}.") for prefix in never):
                found.append(f"{where}:{line}: {module} ({rule})")
    return found


def test_single_modules_never_import_what_their_rows_rule_out() -> None:
    assert modules_importing_what_they_never_do() == []


# -- each check fails where its rule is broken -------------------------------------------------------------
def whole_tree_with(tmp_path: Path, placed: str, line: str) -> Path:
    """A copy of app/, models/ and cache/ in tmp_path, with `line` added to `placed` inside a function at its
    end (or at its top, when the line starts with 'top:')."""
    for path in python_files("app", "models", "cache"):
        copy = tmp_path / relative(path)
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.write_text(path.read_text())
    target = tmp_path / placed
    text = target.read_text()
    if line.startswith("top:"):
        target.write_text(f"{line.removeprefix('top:')}\n{text}")
    else:
        target.write_text(f"{text}\n\ndef added_later(self, path, engine, data):\n    {line}\n")
    return target


Check = Callable[[Path], list[str]]


def over(folder: str, check: Callable[[list[Path], Path], list[str]]) -> Check:
    """`check` over every module of `folder` in a tree."""
    return lambda root: check(python_files(folder, root=root), root)


def over_app_and_models(root: Path) -> list[str]:
    return entries_named_outside_their_table(python_files("app", "models", root=root), root)


BROKEN_RULES: list[tuple[str, str, Check]] = [
    ("cache/paged.py", "keyframe_policy = None", over("cache", stream_ideas_in_the_cache)),
    ("cache/pages.py", "return engine.pose", over("cache", stream_ideas_in_the_cache)),
    ("app/run/pipeline.py", "return engine._rollover", over("app", app_reaching_into_internals)),
    ("app/run/loading.py", "from stream_recon.models.builds.prepare import _placed_copy",
     over("app", app_reaching_into_internals)),
    ("app/commands/run.py", "top:from stream_recon.app.sources.opening import source_name", heavy_imports_of_the_commands),
    ("app/commands/_options.py", "top:import torch", heavy_imports_of_the_commands),
    ("app/options.py", "top:from stream_recon.models.stream.memory import plan_memory", heavy_imports_of_the_commands),
    ("app/outputs/export.py", "open(path, 'w').write('x')", over("app", files_written_past_atomic_write)),
    ("app/evaluation/batch.py", "path.write_text('x')", over("app", files_written_past_atomic_write)),
    ("app/evaluation/metrics.py", "np.savez(path, depth=data)", over("app", files_written_past_atomic_write)),
    ("app/outputs/writers.py", "path.with_suffix('.tmp').replace(path)", over("app", files_written_past_atomic_write)),
    ("app/run/loading.py", "return path.startswith('flashinfer')", over("app", backends_named_in_the_app)),
    ("models/loops/closer.py", "import threading", modules_importing_what_they_never_do),
    ("models/loops/corrections.py", "import torch", modules_importing_what_they_never_do),
    ("models/stream/chunks.py", "from .engine import StreamingEngine", modules_importing_what_they_never_do),
    ("models/stream/chunked.py", "return engine.policy.kind == 'flow'", over_app_and_models),
    ("app/run/pipeline.py", "return data.keyframes != 'flow'", over_app_and_models),
    ("models/stream/engine.py", "return isinstance(engine.policy, IntervalKeyframes)", over_app_and_models),
    ("app/commands/export.py", "return data is ExportFormat.TUM", over_app_and_models),
]


@pytest.mark.parametrize(("placed", "line", "check"), BROKEN_RULES, ids=[f"{p}:{line}" for p, line, _ in BROKEN_RULES])
def test_each_check_names_the_line_that_breaks_its_rule(tmp_path: Path, placed: str, line: str, check: Check) -> None:
    assert check(ROOT) == []  # the real tree keeps the rule
    whole_tree_with(tmp_path, placed, line)
    found = check(tmp_path)
    assert found and all(placed in problem for problem in found), found


# -- the map's list of rules names tests that exist ----------------------------------------------------------
def named_in_the_map(doc: str) -> list[tuple[str, str | None]]:
    """(test file, test function or None for the whole file) for each test the section "Rules and their tests"
    names; a function belongs to the file named before it in its row."""
    section = doc.split("## Rules and their tests", 1)[1].split("\n## ", 1)[0]
    named = []
    for row in (line for line in section.splitlines() if line.startswith("| ") and "`" in line):
        current = None
        for token in re.findall(r"`([^`]+)`", row.split(" | ")[-1]):
            if token.startswith("tests/"):
                current = token
                named.append((current, None))
            elif token.startswith("test_"):
                named.append((current, token))
    return named


def missing_tests(doc: str, root: Path | None = None) -> list[str]:
    base = root or ROOT
    missing = []
    for file, function in named_in_the_map(doc):
        path = base / file if file else None
        if path is None or not path.exists():
            missing.append(f"{file}: no such file")
        elif function and not re.search(rf"^def {function}\(", path.read_text(), re.MULTILINE):
            missing.append(f"{file}: no {function}")
    return missing


def test_every_test_the_map_names_exists() -> None:
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    assert len(named_in_the_map(doc)) >= 20
    assert missing_tests(doc) == []
    renamed = doc.replace("test_the_app_packages_hold_no_code", "test_the_app_packages_are_small")
    assert missing_tests(renamed) == ["tests/test_architecture_rules.py: no test_the_app_packages_are_small"]


# -- what reading a finished run loads ------------------------------------------------------------------------------
# export, view and eval read npz files and write or show what is in them: importing torch would add 2-5 s to each
# (on a busy 2-core machine) for nothing
TORCH_FREE_MODULES = ("stream_recon.app.cli", "stream_recon.app.outputs.export", "stream_recon.app.outputs.writers",
                      "stream_recon.app.viewer.replay", "stream_recon.app.evaluation.metrics",
                      "stream_recon.app.sources.opening")


def test_reading_a_finished_run_never_imports_torch() -> None:
    probe = (f"import sys\nfor name in {TORCH_FREE_MODULES!r}:\n    __import__(name)\n"
             "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout[:300]


# -- a file holds one concern: its length says when it holds more ------------------------------------------
# The files a maintainer opens first (the run directory, the run's pipeline, the source's reader) hold at most
# 450 lines, every other file of app/, models/ and cache/ at most 600: past that a file holds more than one
# concern and is split by concern (docs/ARCHITECTURE.md maps the pieces). A kernel file (one that defines a
# Triton or Gluon kernel: the kernel, its launch and its schedule share one compiled program's constants) is
# exempt.
FIRST_READ_FILES = ("app/outputs/rundir.py", "app/run/pipeline.py", "app/sources/reader.py")
MAX_FIRST_READ_LINES, MAX_PRODUCT_FILE_LINES = 450, 600


def defines_a_kernel(path: Path) -> bool:
    """Whether a function of the file is a Triton or Gluon kernel (`@triton.jit`, `@gluon.jit(...)`)."""
    for node in ast.walk(parsed_source(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                name = ast.unparse(decorator.func if isinstance(decorator, ast.Call) else decorator)
                if name in ("triton.jit", "gluon.jit"):
                    return True
    return False


def files_too_long(paths: list[Path], root: Path | None = None) -> list[str]:
    """'file: N lines (at most M)' for each file over its limit; kernel files are not counted."""
    found = []
    for path in paths:
        where = relative(path, root)
        limit = MAX_FIRST_READ_LINES if where in FIRST_READ_FILES else MAX_PRODUCT_FILE_LINES
        lines = len(path.read_text().splitlines())
        if lines > limit and not defines_a_kernel(path):
            found.append(f"{where}: {lines} lines (at most {limit}: split it by concern)")
    return found


def test_no_product_file_is_longer_than_its_limit() -> None:
    kernels = {relative(path) for path in python_files("cache", "models") if defines_a_kernel(path)}
    assert {"cache/triton_attention.py", "cache/gluon_attention.py", "cache/tile_pieces.py",
            "cache/triton_store.py"} <= kernels  # the scan tells a kernel file
    assert all((ROOT / path).exists() for path in FIRST_READ_FILES)
    assert files_too_long(python_files("app", "models", "cache")) == []


@pytest.mark.parametrize(("placed", "lines", "limit"), [("app/run/pipeline.py", 451, 450),
                                                        ("app/outputs/writers.py", 601, 600)])
def test_a_file_over_its_limit_is_named_with_its_length(tmp_path: Path, placed: str, lines: int, limit: int) -> None:
    copy = tmp_path / placed
    copy.parent.mkdir(parents=True)
    text = (ROOT / placed).read_text()
    copy.write_text(text + "\n" * (lines - len(text.splitlines())))
    assert files_too_long([copy], tmp_path) == [f"{placed}: {lines} lines (at most {limit}: split it by concern)"]


# -- the builds: one room, small, with one piece of process-wide state ----------------------------------------
MAX_BUILD_FILES, MAX_BUILD_LINES = 9, 2_000


def test_the_build_code_is_one_room_of_at_most_nine_files_and_two_thousand_lines() -> None:
    files = sorted((ROOT / "models" / "builds").glob("*.py"))
    lines = sum(len(path.read_text().splitlines()) for path in files)
    assert len(files) <= MAX_BUILD_FILES and lines <= MAX_BUILD_LINES, (len(files), lines)


def unchanging(value: object) -> bool:
    """Whether a value at a module's top cannot change while the process runs: a number, string, dtype or
    None, a tuple, frozenset or read-only mapping of such, a frozen dataclass, an enum member, a function,
    a class, a logger (logging's own)."""
    import dataclasses
    import enum
    import logging
    import types

    import torch

    if isinstance(value, (int, float, str, bytes, type(None), enum.Enum, type, logging.Logger, torch.dtype,
                          types.FunctionType)):
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(unchanging(item) for item in value)
    if isinstance(value, types.MappingProxyType):
        return all(unchanging(item) for item in value.values())
    return dataclasses.is_dataclass(value) and type(value).__dataclass_params__.frozen


def process_wide_state(module_name: str, path: Path) -> list[str]:
    """The names a module binds at its top (assignments, not imports or definitions) to something that can
    change: state the whole process shares."""
    import importlib

    module = importlib.import_module(module_name)
    assigned = [target.id for node in parsed_source(path).body if isinstance(node, (ast.Assign, ast.AnnAssign))
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                if isinstance(target, ast.Name)]
    assigned += [name for name in vars(module) if name not in assigned and not name.startswith("__")
                 and type(vars(module)[name]) in (dict, list, set)]  # (one set from a function, say)
    return [name for name in assigned if name != "__all__" and not unchanging(getattr(module, name))]


def test_the_builds_keep_one_piece_of_process_wide_state() -> None:
    """Triton's cache hook and whether building ahead still works are the process's; all of it lives in one
    object (kernel_builds.PROCESS), so a test or a reader finds it in one place."""
    state = [f"{path.stem}.{name}" for path in sorted((ROOT / "models" / "builds").glob("*.py"))
             for name in process_wide_state(f"stream_recon.models.builds.{path.stem}", path)]
    assert state == ["kernel_builds.PROCESS"]


def test_a_second_piece_of_build_state_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    from stream_recon.models.builds import compilation

    monkeypatch.setattr(compilation, "_compiled_keys", set(), raising=False)
    path = ROOT / "models" / "builds" / "compilation.py"
    assert process_wide_state("stream_recon.models.builds.compilation", path) == ["_compiled_keys"]
