"""Which part of the package may import which: app -> models -> cache, and inside models/ its rooms.

Every module's imports (absolute and relative, at the top or inside a function) are read with `ast`,
without importing anything. The rooms of models/ (docs/ARCHITECTURE.md has the map):

    network   the model's modules and heads          imports nothing of builds, stream, loops, app
    builds    what is built, when and where          imports nothing of loops, app (it drives engines)
    stream    engine, steps, chunks, rollover, ...   imports nothing of builds, loops, app
    loops     loop closure                           imports nothing of network, builds, app

models/ imports nothing of the app, the cache nothing of models/ or the app, and the app nothing of the
cache (what it needs of the backend table is models/attention_backends.py). The modules left at models/'s
top are shared: they import no room, except checkpoint, which builds the network. Two rooms are held to
a list: loops imports of models/ only the stream's outputs and the helpers' contract (LOOPS_MAY_IMPORT), and
the network takes of the cache nothing that names a layout, a storage or a backend (NETWORK_TAKES_FROM_CACHE).

app/ stands in rooms the same way (APP_FORBIDDEN below; each room's __init__.py docstring says the same):

    commands    one module per command                   may import anything of the app
    sources     opening, the reader, probing, the crop   imports nothing of run, outputs, evaluation, viewer
    outputs     run directory, writer, exports, masks    imports nothing of run, evaluation, viewer
    viewer      the live viewer and the replay           imports nothing of sources, run, evaluation
    run         pipeline, loading, builds, loops sink    imports nothing of evaluation
    evaluation  metrics, datasets, batch                 imports nothing of viewer

and the module graph of app/, models/ and cache/ together has no circle, the app reaches models/ through at
most 15 modules, and at most 45 imports sit inside functions, each with its reason.
"""

from __future__ import annotations

import ast
import importlib
import io
import re
import shutil
import tokenize
from pathlib import Path

import pytest
from helpers import parsed_source

REPO = Path(__file__).resolve().parents[1]
ROOMS = ("network", "builds", "stream", "loops")
FORBIDDEN = {
    "network": {"builds", "stream", "loops", "app"},
    "builds": {"loops", "app"},
    "stream": {"builds", "loops", "app"},
    "loops": {"network", "builds", "app"},
    "models": {"app"},  # every module of models/, a room's or the top's
    "cache": {"models", "app"},
    "app": {"cache"},
}
TOP_MAY_IMPORT = {"checkpoint": {"network"}}  # every other module at models/'s top: no room
MAX_TOP_MODULES = 10  # `ls models/*.py | wc -l`, __init__.py included


def lazy_homes() -> dict[str, str]:
    """models/__init__.py's _HOMES (name -> its module under models/), read without importing it."""
    tree = parsed_source(REPO / "models" / "__init__.py")
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_HOMES" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("models/__init__.py has no _HOMES")


def area(dotted: str) -> str:
    """'app', 'cache', 'configs', a room's name, 'top:<module>' for a module at models/'s top, or 'models'
    for the package itself."""
    parts = dotted.split(".")
    if parts[0] != "models":
        return parts[0]
    if len(parts) == 1:
        return "models"
    return parts[1] if parts[1] in ROOMS else f"top:{parts[1]}"


def imported_areas(path: Path) -> list[tuple[int, str, str]]:
    """(line, what the source says, the area it reaches) for each import of stream_recon in `path`."""
    relative = path.relative_to(REPO).with_suffix("")
    module = ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)
    package = module if relative.name == "__init__" else module.rpartition(".")[0]
    homes = lazy_homes()
    found = []
    for node in ast.walk(parsed_source(path)):
        if isinstance(node, ast.Import):
            targets = [alias.name.removeprefix("stream_recon.") for alias in node.names
                       if alias.name.startswith("stream_recon.")]
            found += [(node.lineno, f"import stream_recon.{target}", area(target)) for target in targets]
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            source = "." * node.level + (node.module or "")
            target = ".".join(base + ([node.module] if node.module else []))
        elif node.module and (node.module == "stream_recon" or node.module.startswith("stream_recon.")):
            source = node.module
            target = node.module.removeprefix("stream_recon").lstrip(".")
        else:
            continue
        for alias in node.names:
            reached = area(target) if target else area(alias.name)
            if reached == "models":  # `from stream_recon.models import X`: a room, a module, or a lazy name
                if alias.name in ROOMS or (REPO / "models" / f"{alias.name}.py").exists():
                    reached = area(f"models.{alias.name}")
                elif alias.name in homes:
                    reached = area(f"models.{homes[alias.name]}")
            found.append((node.lineno, f"from {source} import {alias.name}", reached))
    return found


def modules(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def where(path: Path) -> list[str]:
    """The keys of FORBIDDEN and TOP_MAY_IMPORT that govern `path`."""
    parts = path.relative_to(REPO).parts
    if parts[0] != "models":
        return [parts[0]]
    return ["models", parts[1]] if parts[1] in ROOMS else ["models", f"top:{path.stem}"]


def violations(paths: list[Path]) -> list[str]:
    """'file:line: the import (the rule it breaks)' for each import against the directions."""
    found = []
    for path in paths:
        for line, source, reached in imported_areas(path):
            for key in where(path):
                if key.startswith("top:"):
                    allowed = TOP_MAY_IMPORT.get(key.removeprefix("top:"), set())
                    if key != "top:__init__" and reached in ROOMS and reached not in allowed:
                        rule = f"a module at models/'s top imports no room{' but ' if allowed else ''}" + \
                               ", ".join(sorted(allowed))
                        found.append(f"{path.relative_to(REPO)}:{line}: {source} ({rule})")
                        break
                    continue
                forbidden = FORBIDDEN.get(key, set())
                in_models = reached == "models" or reached in ROOMS or reached.startswith("top:")
                if reached in forbidden or (in_models and "models" in forbidden):
                    what = reached if reached in forbidden else "models"
                    found.append(f"{path.relative_to(REPO)}:{line}: {source} ({key} imports nothing of {what})")
                    break  # one rule per import is enough to name
    return found


def test_every_module_imports_only_in_the_allowed_directions() -> None:
    assert violations([*modules("models"), *modules("app"), *modules("cache")]) == []


@pytest.mark.parametrize("source, placed, expected", [
    ("from ..stream.engine import StreamingEngine", "models/network/gct.py", "network imports nothing of stream"),
    ("from .. import StreamingEngine", "models/network/gct.py", "network imports nothing of stream"),
    ("from ..builds import kernel_builds", "models/network/layers.py", "network imports nothing of builds"),
    ("from stream_recon.models.loops.closer import LoopCloser", "models/stream/engine.py",
     "stream imports nothing of loops"),
    ("from ..builds import kernel_builds", "models/stream/steps.py", "stream imports nothing of builds"),
    ("from stream_recon.app.options import RunOptions", "models/stream/chunked.py",
     "models imports nothing of app"),
    ("from ..network import gct", "models/loops/closer.py", "loops imports nothing of network"),
    ("from stream_recon.cache import backends", "app/options.py", "app imports nothing of cache"),
    ("import stream_recon.cache.backends", "app/options.py", "app imports nothing of cache"),
    ("from stream_recon.models.errors import FrameError", "cache/backends/__init__.py", "cache imports nothing of models"),
    ("from ...models import StreamConfig", "cache/backends/triton.py", "cache imports nothing of models"),
    ("from .stream.engine import StreamingEngine", "models/supervision.py", "models/'s top imports no room"),
])
def test_a_forbidden_import_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, placed: str,
                                      expected: str) -> None:
    """The check itself: one forbidden line added to a real module fails it."""
    copy = tmp_path / placed
    copy.parent.mkdir(parents=True)
    copy.write_text(f"{(REPO / placed).read_text()}\n\ndef later():\n    {source}\n")
    (tmp_path / "models").mkdir(exist_ok=True)
    for name in ("__init__.py", "errors.py"):  # what area() and lazy_homes() read
        if not (tmp_path / "models" / name).exists():
            (tmp_path / "models" / name).write_text((REPO / "models" / name).read_text())
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    found = violations([copy])
    assert len(found) == 1 and expected in found[0], found


# Loop closure reads the stream's outputs, never runs it: of models/ it imports only these (and itself).
LOOPS_MAY_IMPORT = {"models.stream.similarity", "models.stream.pose", "models.stream.chunks",
                    "models.stream.prediction", "models.child_process", "models.supervision"}
# The network attends through the callable the engine hands it: of the cache it takes the half precisions,
# the package probe and the side-stream helper, never a layout, storage or backend.
NETWORK_TAKES_FROM_CACHE = {"HALF_DTYPES", "importable", "run_beside"}


def imported_names(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, the stream_recon module imported from or imported, without the prefix, the name taken from
    it or None) for each import of stream_recon in `path`; a name that is a module of its own is folded
    into the module (`from ..stream import pose` -> ("models.stream.pose", None))."""
    relative = path.relative_to(REPO).with_suffix("")
    module = ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)
    package = module if relative.name == "__init__" else module.rpartition(".")[0]
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(parsed_source(path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.removeprefix("stream_recon."), None) for alias in node.names
                      if alias.name.startswith("stream_recon.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                target = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("stream_recon."):
                target = node.module.removeprefix("stream_recon.")
            else:
                continue
            for alias in node.names:
                folder = REPO.joinpath(*f"{target}.{alias.name}".split("."))
                is_module = folder.with_suffix(".py").exists() or (folder / "__init__.py").exists()
                found.append((node.lineno, f"{target}.{alias.name}", None) if is_module
                             else (node.lineno, target, alias.name))
    return found


def loops_reaching_past_their_list(paths: list[Path]) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line}: {target}" for path in paths for line, target, _ in imported_names(path)
            if target.startswith("models") and not target.startswith("models.loops") and target not in LOOPS_MAY_IMPORT]


def network_taking_cache_internals(paths: list[Path]) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line}: {target} {name or ''}" for path in paths
            for line, target, name in imported_names(path)
            if target.split(".")[0] == "cache" and name not in NETWORK_TAKES_FROM_CACHE]


def test_loop_closure_imports_of_models_only_the_streams_outputs_and_the_helpers_contract() -> None:
    assert loops_reaching_past_their_list(modules("models/loops")) == []


def test_the_network_takes_nothing_of_the_cache_that_names_a_layout_or_a_backend() -> None:
    assert network_taking_cache_internals(modules("models/network")) == []


@pytest.mark.parametrize("source, placed, check", [
    ("from ..stream.engine import StreamingEngine", "models/loops/closer.py", loops_reaching_past_their_list),
    ("from ..stream import chunked", "models/loops/process.py", loops_reaching_past_their_list),
    ("from ..daemon_pool import DaemonPool", "models/loops/process.py", loops_reaching_past_their_list),
    ("from stream_recon.cache import PagedKV", "models/network/layers.py", network_taking_cache_internals),
    ("from stream_recon.cache.backends import resolve", "models/network/gct.py", network_taking_cache_internals),
    ("from stream_recon.cache import triton_attention", "models/network/gct.py", network_taking_cache_internals),
])
def test_a_room_reaching_past_its_list_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str,
                                                 placed: str, check) -> None:
    copy = tmp_path / placed
    copy.parent.mkdir(parents=True)
    copy.write_text(f"{(REPO / placed).read_text()}\n\ndef later():\n    {source}\n")
    for folder in ("models", "cache"):  # what imported_names looks up to tell a module from a name
        for module in (REPO / folder).rglob("*.py"):
            twin = tmp_path / module.relative_to(REPO)
            twin.parent.mkdir(parents=True, exist_ok=True)
            if not twin.exists():
                twin.write_text("")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    found = check([copy])
    assert len(found) == 1 and found[0].startswith(f"{placed}:"), found


def test_models_top_keeps_at_most_ten_modules() -> None:
    top = sorted(path.name for path in (REPO / "models").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules at models/'s top: {top}; put new ones in a room"


@pytest.mark.parametrize("room", ROOMS)
def test_each_room_says_what_it_owns_and_what_it_may_import(room: str) -> None:
    docstring = ast.get_docstring(parsed_source(REPO / "models" / room / "__init__.py")) or ""
    assert re.search(r"\bimport", docstring, re.IGNORECASE), f"models/{room}/__init__.py: what may it import?"
    if room == "loops":  # its docstring names what it imports from the rest of models/ in its own words
        return
    may = re.search(r"^May import: (.+?)$", docstring, re.MULTILINE | re.DOTALL)
    nothing = re.search(r"^Imports nothing of: (.+?)\.$", docstring, re.MULTILINE)
    assert may and nothing, f"models/{room}/__init__.py: a 'May import:' and an 'Imports nothing of:' line"
    assert set(nothing.group(1).split(", ")) == FORBIDDEN[room]


def test_the_lazy_names_of_models_point_at_their_homes() -> None:
    for name, home in lazy_homes().items():
        assert hasattr(importlib.import_module(f"stream_recon.models.{home}"), name), (name, home)


def test_every_package_folder_is_in_the_wheel() -> None:
    tomllib = pytest.importorskip("tomllib")
    settings = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {f"stream_recon.{package}": folder for package, folder in
               ((name.removeprefix("stream_recon."), folder) for name, folder in settings["package-dir"].items())}
    found = {
        ".".join([name, *init.parent.relative_to(REPO / folder).parts])
        for name, folder in folders.items() for init in (REPO / folder).rglob("__init__.py")
    }
    assert found - set(settings["packages"]) == set()


# -- app/'s rooms ------------------------------------------------------------------------------------------
# The rooms of app/ (app/__init__.py has the map), and what each imports nothing of. The modules left at app/'s
# top are shared: options (what a run is asked) and stopping (signals) import no room but the light settings
# the flags read (APP_TOP_MAY_IMPORT); cli, the root command, registers the commands.
APP_ROOMS = ("commands", "sources", "run", "outputs", "evaluation", "viewer")
APP_FORBIDDEN = {
    "commands": set(),
    "sources": {"run", "outputs", "evaluation", "viewer", "commands"},
    "outputs": {"run", "evaluation", "viewer", "commands"},
    "viewer": {"sources", "run", "evaluation", "commands"},
    "run": {"evaluation", "commands"},
    "evaluation": {"viewer", "commands"},
}
APP_TOP_MAY_IMPORT = {
    "cli": {"commands", "app.outputs.formats"},
    "options": {"app.sources.input_size", "app.sources.settings", "app.outputs.npz_schema"},
    "stopping": set(),
}
MAX_APP_TOP_MODULES = 10  # `ls app/*.py | wc -l`, __init__.py and cli.py included


def app_room(dotted: str) -> str | None:
    """The room of app/ a module is in ('app.run.pipeline' -> 'run'), or None at app/'s top or outside it."""
    parts = dotted.split(".")
    return parts[1] if parts[0] == "app" and len(parts) >= 2 and parts[1] in APP_ROOMS else None


def app_rooms_broken(paths: list[Path]) -> list[str]:
    """'file:line: module (the rule)' for each import of an app module against APP_FORBIDDEN and
    APP_TOP_MAY_IMPORT (a room's package itself, a docstring, is reached by every import into it and is
    no import of the room's)."""
    found = []
    for path in paths:
        relative = path.relative_to(REPO)
        here = relative.parts[1] if len(relative.parts) > 2 else None
        for line, target, _ in imported_names(path):
            if not target.startswith("app.") or target.count(".") < 1:
                continue
            room = app_room(target)
            if here is None:  # a module at app/'s top
                allowed = APP_TOP_MAY_IMPORT.get(path.stem, set())
                if room is not None and room not in allowed and target not in allowed:
                    found.append(f"{relative}:{line}: {target} (app/{path.name} imports no room"
                                 f"{' but ' + ', '.join(sorted(allowed)) if allowed else ''})")
            elif room in APP_FORBIDDEN[here]:
                found.append(f"{relative}:{line}: {target} ({here} imports nothing of {room})")
    return found


def test_every_app_module_imports_only_the_rooms_it_may() -> None:
    assert app_rooms_broken(modules("app")) == []


@pytest.mark.parametrize("source, placed, expected", [
    ("from stream_recon.app.run.pipeline import run_sequence", "app/sources/reader.py",
     "sources imports nothing of run"),
    ("from stream_recon.app.outputs.rundir import atomic_write", "app/sources/opening.py",
     "sources imports nothing of outputs"),
    ("from stream_recon.app.run.loading import load_model_for", "app/outputs/export.py",
     "outputs imports nothing of run"),
    ("from stream_recon.app.viewer import LiveViewer", "app/outputs/writers.py",
     "outputs imports nothing of viewer"),
    ("from stream_recon.app.run import clock", "app/viewer/scene.py", "viewer imports nothing of run"),
    ("from stream_recon.app.evaluation.batch import run_batch", "app/run/pipeline.py",
     "run imports nothing of evaluation"),
    ("from stream_recon.app.viewer.replay import start_replay", "app/evaluation/metrics.py",
     "evaluation imports nothing of viewer"),
    ("from stream_recon.app.commands import run", "app/run/pipeline.py", "run imports nothing of commands"),
    ("from stream_recon.app.run.presets import build_options", "app/options.py", "app/options.py imports no room"),
    ("from stream_recon.app.sources.reader import SourceError", "app/stopping.py", "app/stopping.py imports no room"),
])
def test_a_forbidden_app_import_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str,
                                          placed: str, expected: str) -> None:
    """The check itself: one forbidden line added to a real module fails it."""
    copy = tmp_path / placed
    copy.parent.mkdir(parents=True)
    copy.write_text(f"{(REPO / placed).read_text()}\n\ndef later():\n    {source}\n")
    for module in (REPO / "app").rglob("*.py"):  # what imported_names looks up to tell a module from a name
        twin = tmp_path / module.relative_to(REPO)
        twin.parent.mkdir(parents=True, exist_ok=True)
        if not twin.exists():
            twin.write_text("")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    found = app_rooms_broken([copy])
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize("room", [room for room in APP_ROOMS])
def test_each_app_room_says_what_it_holds_and_what_it_may_import(room: str) -> None:
    docstring = ast.get_docstring(parsed_source(REPO / "app" / room / "__init__.py")) or ""
    may = re.search(r"^May import: (.+?)$", docstring, re.MULTILINE | re.DOTALL)
    nothing = re.search(r"^Imports nothing of: (.+?)\.$", docstring, re.MULTILINE)
    assert may and nothing, f"app/{room}/__init__.py: a 'May import:' and an 'Imports nothing of:' line"
    said = set(nothing.group(1).split(", "))
    assert said == (APP_FORBIDDEN[room] or {"stream_recon.cache"}), (room, said)


def test_app_top_keeps_at_most_ten_modules() -> None:
    top = sorted(path.name for path in (REPO / "app").glob("*.py"))
    assert len(top) <= MAX_APP_TOP_MODULES, f"{len(top)} modules at app/'s top: {top}; put new ones in a room"
    assert {path.stem for path in (REPO / "app").glob("*.py")} - {"__init__"} <= set(APP_TOP_MAY_IMPORT)


# -- the module graph: no circle, few doors from the app into models/, few imports inside functions -----------
# How it is counted: a node is a module of app/, models/ or cache/ (a package is its __init__.py); an edge is
# every import of one of ours in it, at its top, inside a function or in an `if TYPE_CHECKING:` block alike,
# to the module it names (`from stream_recon.models.stream import pose` -> models.stream.pose; a name taken
# from a package -> the package), and every import by a string (STRING_IMPORTS_SAY): a string naming one of our
# modules ("stream_recon.app.run.pipeline", "module:function" for either), `importlib.import_module` of a
# constant relative name, a package's lazy names (its `_HOMES`), and a package that imports its folder's
# files by name (`import_module(f".{name}", __name__)` in its __init__.py: a table made of files, such as the
# attention backends' and the export formats').
MAX_MODELS_MODULES_THE_APP_IMPORTS = 15
MAX_IMPORTS_INSIDE_FUNCTIONS = 45  # across app/, models/ and cache/; each with its reason
MODULE_STRING = re.compile(r"stream_recon((?:\.\w+)+)(?::[\w.]+)?")


def module_of(path: Path) -> str:
    """'app.outputs.formats' for app/outputs/formats/__init__.py, 'app.run.pipeline' for app/run/pipeline.py."""
    relative = path.relative_to(REPO).with_suffix("")
    return ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)


def is_our_module(dotted: str) -> bool:
    folder = REPO.joinpath(*dotted.split("."))
    return folder.with_suffix(".py").exists() or (folder / "__init__.py").exists()


def imported_by_string(path: Path) -> set[str]:
    """The modules of ours `path` imports by a string (the kinds the graph's comment lists)."""
    module = module_of(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(parsed_source(path)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = MODULE_STRING.fullmatch(node.value)
            if named and is_our_module(named.group(1)[1:]):
                found.add(named.group(1)[1:])
        elif isinstance(node, ast.Assign) and path.name == "__init__.py" \
                and any(getattr(target, "id", None) == "_HOMES" for target in node.targets):
            found |= {f"{package}.{home}" for home in ast.literal_eval(node.value).values()}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == \
                "import_module" and node.args:
            name = node.args[0]
            if isinstance(name, ast.Constant) and str(name.value).startswith("."):
                found.add(f"{package}.{name.value.lstrip('.').partition(':')[0]}")
            elif isinstance(name, ast.JoinedStr) and path.name == "__init__.py":  # the folder's files, by name
                found |= {f"{package}.{file.stem}" for file in path.parent.glob("*.py") if file.stem != "__init__"}
    return {target for target in found if target != module and is_our_module(target)}


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ours it imports, by a statement anywhere in it or by a string."""
    graph: dict[str, set[str]] = {}
    for path in [*modules("app"), *modules("models"), *modules("cache")]:
        name = module_of(path)
        graph[name] = {target for _, target, _ in imported_names(path)
                       if target.split(".")[0] in ("app", "models", "cache") and target != name}
        graph[name] |= imported_by_string(path)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in graph:
                    continue
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circle_among_the_apps_the_models_and_the_caches_modules() -> None:
    assert circles(import_graph()) == []


def test_the_circle_check_finds_a_circle_through_an_import_inside_a_function() -> None:
    graph = import_graph()
    graph["models.loops.consistency"].add("models.loops.pose_graph")  # pose_graph imports consistency
    assert ["models.loops.consistency", "models.loops.pose_graph"] in circles(graph)


@pytest.mark.parametrize("added", [
    "if TYPE_CHECKING:\n    from stream_recon.models.loops.pose_graph import PoseGraphSolver",
    "SOLVER = 'stream_recon.models.loops.pose_graph'",
    "SOLVE = 'stream_recon.models.loops.pose_graph:optimize'",
    "def solver():\n    return importlib.import_module('.pose_graph', __package__)",
])
def test_the_circle_check_finds_a_circle_through_a_typing_import_or_an_import_by_string(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, added: str) -> None:
    """pose_graph imports consistency: a line of consistency.py reaching pose_graph back closes a circle."""
    for folder in ("app", "models", "cache"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    consistency = tmp_path / "models" / "loops" / "consistency.py"
    consistency.write_text(f"{consistency.read_text()}\n\n{added}\n")
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    assert ["models.loops.consistency", "models.loops.pose_graph"] in circles(import_graph())


def test_a_table_made_of_a_folders_files_imports_each_of_them() -> None:
    """The export formats' table imports its files by name: each is an edge of the graph, as an import is."""
    graph = import_graph()
    files = {f"app.outputs.formats.{path.stem}" for path in (REPO / "app" / "outputs" / "formats").glob("*.py")
             if path.stem != "__init__"}
    assert len(files) >= 6 and files <= graph["app.outputs.formats"]
    assert {"cache.backends.sdpa", "cache.backends.triton"} <= graph["cache.backends"]


def models_modules_the_app_imports() -> list[str]:
    """The modules of models/ an import in app/ names (`from stream_recon.models import X`, a lazy name:
    the package)."""
    return sorted({target for path in modules("app") for _, target, _ in imported_names(path)
                   if target.split(".")[0] == "models"})


def test_the_app_reaches_models_through_at_most_fifteen_modules() -> None:
    reached = models_modules_the_app_imports()
    assert len(reached) <= MAX_MODELS_MODULES_THE_APP_IMPORTS, reached


def imports_inside_functions(path: Path) -> list[tuple[int, bool]]:
    """(line, whether a comment gives its reason) for each import statement inside a function of `path`. A
    reason is a comment on the import's lines, or on the line above the run of import lines it belongs to
    (one comment may give the reason of a group)."""
    text = path.read_text()
    comments = {token.start[0] for token in tokenize.generate_tokens(io.StringIO(text).readline)
                if token.type == tokenize.COMMENT}
    inside = [node for function in ast.walk(ast.parse(text))
              if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
              for node in ast.walk(function) if isinstance(node, (ast.Import, ast.ImportFrom))]
    import_lines = {line for node in inside for line in range(node.lineno, node.end_lineno + 1)}
    found = []
    for node in inside:
        first, last = node.lineno, node.end_lineno
        while first - 1 in import_lines:
            first -= 1
        while last + 1 in import_lines:
            last += 1
        found.append((node.lineno, any(line in comments for line in range(first - 1, last + 1))))
    return sorted(set(found))


def test_imports_inside_functions_are_few_and_each_says_why() -> None:
    found = {f"{path.relative_to(REPO)}:{line}": reason for path in [*modules("app"), *modules("models"),
                                                                      *modules("cache")]
             for line, reason in imports_inside_functions(path)}
    assert len(found) <= MAX_IMPORTS_INSIDE_FUNCTIONS, f"{len(found)} imports inside functions"
    assert [where for where, reason in found.items() if not reason] == []


def test_an_import_inside_a_function_without_a_reason_is_caught(tmp_path: Path) -> None:
    module = tmp_path / "module.py"
    module.write_text("def why():\n    # torch: only when asked\n    import torch\n    import numpy\n\n\n"
                      "def not_why():\n    x = 1  # a comment about something else, two lines up\n\n"
                      "    import json\n")
    assert imports_inside_functions(module) == [(3, True), (4, True), (10, False)]


# -- the frame's path knows nothing of what is built for it -------------------------------------------------
FRAME_PATH = ("models.stream.engine", "models.stream.steps", "models.stream.graphs")


def reached_from(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for target in graph.get(todo.pop(), set()) - seen:
            seen.add(target)
            todo.append(target)
    return seen


@pytest.mark.parametrize("module", FRAME_PATH)
def test_the_frame_path_reaches_no_build_module(module: str) -> None:
    """The engine and its step runners are handed a dry-pass context and a step mode by the builder
    (models/builds/plan.py); nothing they import, directly or through another module, is a build module."""
    assert sorted(m for m in reached_from(import_graph(), module) if m.startswith("models.builds")) == []


def test_the_frame_path_check_sees_a_build_module_reached_through_another_module() -> None:
    graph = import_graph()
    graph["models.stream.staging"].add("models.builds.kernel_builds")
    assert "models.builds.kernel_builds" in reached_from(graph, "models.stream.engine")
