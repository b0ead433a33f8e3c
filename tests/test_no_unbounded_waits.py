"""Nothing on the stream's path waits without a deadline (models/supervision.py's contract).

Every call of a blocking primitive in the modules the run loop and its helpers run (put, get, join, wait,
wait_for, acquire, result, communicate; concurrent.futures.wait; an executor's shutdown(wait=True)) must
say how long it may wait (a timeout or deadline, positional or by name) or that it does not wait
(block=False, _nowait). A call that is bounded another way says so on its line with a comment
`# unbounded-ok: <why>` (a future already done, a method whose own deadline bounds it, a helper's thread
waiting for its next item). The contract's own module and a child process's side of its pipes (which may
wait: its one thread has nothing else to do) are outside the rule.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STREAM_PATH = [
    "app/run/pipeline.py", "app/run/streaming.py", "app/run/loops.py", "app/outputs/writers.py", "app/sources/reader.py",
    "app/sources/preprocessing_pool.py", "app/sources/readers.py", "app/sources/opening.py", "app/sources/probing.py",
    *sorted(path.relative_to(ROOT).as_posix() for path in (ROOT / "app" / "viewer").glob("*.py")
            if path.name != "replay.py"),  # a replay is no stream
    "models/builds/compile_child.py", "models/builds/plan.py", "app/run/progress.py", "app/run/loading.py",
    "models/stream/chunked.py", "models/stream/rollover.py", "models/stream/lookahead.py", "models/stream/engine.py",
    "models/builds/ahead.py", "models/builds/while_streaming.py", "models/builds/kernel_builds.py", "models/loops/process.py",
    "models/child_process.py", "models/daemon_pool.py", "app/stopping.py",
    "cache/triton_attention.py",
]
# a child's own side of its pipes: its one thread waits for the next message by design
CHILD_SIDE = {("models/loops/process.py", "serve"), ("models/child_process.py", "read_message")}
# the number of positional arguments that carries the timeout, per method name
TIMEOUT_POSITION = {"join": 0, "wait": 0, "result": 0, "wait_for": 1, "communicate": 1, "get": 1, "put": 2,
                    "acquire": 1}
STRING_JOIN = (ast.Constant, ast.JoinedStr)
EXCUSED = "# unbounded-ok:"


def unbounded_waits(path: Path) -> list[str]:
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    found = []
    for function, call in calls_by_function(tree):
        if (str(path.relative_to(ROOT)), function) in CHILD_SIDE or EXCUSED in lines[call.lineno - 1]:
            continue
        problem = why_unbounded(call)
        if problem:
            found.append(f"{path.relative_to(ROOT)}:{call.lineno} in {function}: {problem}")
    return found


def calls_by_function(tree: ast.AST):
    def visit(node: ast.AST, function: str):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call):
                yield function, child
            yield from visit(child, name)

    yield from visit(tree, "<module>")


def why_unbounded(call: ast.Call) -> str | None:
    keywords = {keyword.arg: keyword.value for keyword in call.keywords}
    if any(name and ("timeout" in name or "deadline" in name) for name in keywords):
        return None
    if is_false(keywords.get("block")) or is_false(keywords.get("wait")):
        return None
    func = call.func
    if isinstance(func, ast.Name) and func.id == "wait" and len(call.args) < 2:
        return "concurrent.futures.wait without a timeout"
    if not isinstance(func, ast.Attribute):
        return None
    name = func.attr
    if name == "shutdown" and is_true(keywords.get("wait", ast.Constant(True))) and not call.args:
        return "shutdown that waits for its workers"
    if name not in TIMEOUT_POSITION:
        return None
    if name == "join" and isinstance(func.value, STRING_JOIN):
        return None  # str.join
    if name == "get" and call.args and not is_queue_like(func.value):
        return None  # dict.get(key[, default])
    if name == "put" and not is_queue_like(func.value):
        return None
    if len(call.args) > TIMEOUT_POSITION[name]:
        return None
    return f".{name}() without a timeout"


def is_queue_like(node: ast.AST) -> bool:
    text = ast.unparse(node).lower()
    return any(word in text for word in ("queue", "_items", "jobs"))


def is_false(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def is_true(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


@pytest.mark.parametrize("module", STREAM_PATH)
def test_the_stream_path_never_waits_without_a_deadline(module: str) -> None:
    assert unbounded_waits(ROOT / module) == []


def test_the_check_finds_what_it_is_for(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "def f(queue, t, e, pool, fs, d):\n"
        "    queue.put(1)\n    queue.get()\n    t.join()\n    e.wait()\n    pool.shutdown()\n    wait(fs)\n"
        "    queue.put(1, timeout=2)\n    queue.get(timeout=1)\n    t.join(5)\n    e.wait(0.1)\n"
        "    queue.put(1, block=False)\n    d.get('key')\n    ', '.join(['a'])\n    pool.shutdown(wait=False)\n"
        "    e.wait()  # unbounded-ok: the sample's excuse\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = unbounded_waits(sample)
    finally:
        ROOT = saved
    assert [line.split(":")[1].split()[0] for line in found] == ["2", "3", "4", "5", "6", "7"], found
