"""Compiled methods kept between runs (models/builds/compilation.py), on the CPU with TorchInductor's C++ backend."""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

import pytest
import torch

from stream_recon.models.builds import compilation
from stream_recon.models.builds.compilation import (
    CompiledMethods,
    artefacts_dir,
    call_signature,
)
from stream_recon.models.network.custom_ops import operator_for_compiled_code
from stream_recon.models.network.step_mode import StepMode, stepping

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="TorchInductor's CPU backend needs a C++ compiler")


class Half(torch.nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.proj = torch.nn.Linear(dim, 2 * dim)

    def inputs(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.proj(self.norm(x))) * 0.5

    def branchy(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:  # data-dependent: no full graph
            return x * 2
        return x - 1


def prepared(root, *modules: Half, names=("inputs",)) -> CompiledMethods:
    methods = CompiledMethods(root, torch.device("cpu"))
    for module in modules:
        methods.install(module, names)
    return methods


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.slow
def test_a_later_run_loads_what_an_earlier_one_compiled(tmp_path):
    torch.manual_seed(0)
    first_block, second_block = Half(), Half()
    x = torch.randn(2, 5, 16)
    expected = [Half.inputs(block, x) for block in (first_block, second_block)]
    with torch.inference_mode():
        earlier = prepared(tmp_path, first_block, second_block)
        got = [first_block.inputs(x), second_block.inputs(x)]
    # one artefact serves both instances of the class: their weights are inputs, not constants
    assert earlier.counts() == {"loaded": 0, "compiled": 1}
    torch.testing.assert_close(got, expected)
    torch._dynamo.reset()
    third = Half()  # another instance, as a new process's model would be
    with torch.inference_mode():
        later = prepared(tmp_path, third)
        out = third.inputs(x)
    assert later.counts() == {"loaded": 1, "compiled": 0}
    torch.testing.assert_close(out, Half.inputs(third, x))
    assert len(list(tmp_path.rglob("*.pt"))) == 1


def test_each_call_signature_is_compiled_once(tmp_path):
    block = Half()
    with torch.inference_mode():
        methods = prepared(tmp_path, block)
        for rows in (5, 7, 5, 7):
            x = torch.randn(1, rows, 16)
            torch.testing.assert_close(block.inputs(x), Half.inputs(block, x))
    assert methods.counts() == {"loaded": 0, "compiled": 2}
    assert len(list(tmp_path.rglob("*.pt"))) == 2


def test_stepping_as_written_compiles_nothing(tmp_path):
    block = Half()
    x = torch.randn(1, 3, 16)
    with torch.inference_mode(), stepping(StepMode.AS_WRITTEN):
        methods = prepared(tmp_path, block)
        out = block.inputs(x)
    assert methods.counts() == {"loaded": 0, "compiled": 0}
    assert not list(tmp_path.rglob("*.pt"))
    torch.testing.assert_close(out, Half.inputs(block, x))


@pytest.mark.parametrize("kind", ["kept artefacts", "compiled where called"])
def test_a_thread_running_eagerly_leaves_another_one_compiling(tmp_path, kind):
    """The stream steps as written on its thread while the compiled code is made on another
    (models/builds/while_streaming.py): the eager thread's calls are the function's own, and the
    other thread's compile, made while the first is inside its eager block, serves it afterwards."""
    from torch._dynamo.utils import counters

    block = Half()

    def marked(x):  # 1 more where compiled: which code ran shows in the result
        return Half.inputs(block, x) + (1.0 if torch.compiler.is_compiling() else 0.0)

    if kind == "kept artefacts":
        compiled = CompiledMethods(tmp_path, torch.device("cpu")).compile(marked)
    else:
        compiled = compilation.compiled_where_called(marked)
    x = torch.randn(1, 3, 16)
    with torch.inference_mode():
        written = Half.inputs(block, x)
    results: dict[str, torch.Tensor] = {}
    inside, done = threading.Event(), threading.Event()

    def stream():
        with torch.inference_mode(), stepping(StepMode.AS_WRITTEN):
            results["stream before"] = compiled(x)
            inside.set()
            done.wait(timeout=300)
            results["stream after"] = compiled(x)  # still in its eager block, the compiled code made

    def compile_beside():
        inside.wait(timeout=60)
        with torch.inference_mode():
            results["beside"] = compiled(x)
        done.set()

    threads = [threading.Thread(target=stream), threading.Thread(target=compile_beside)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    torch.testing.assert_close(results["stream before"], written)
    torch.testing.assert_close(results["stream after"], written)
    torch.testing.assert_close(results["beside"], written + 1)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), written + 1)  # the compiled code, not compiled again
    assert counters["stats"]["unique_graphs"] == graphs


def test_an_unreadable_artefact_is_compiled_again_and_replaced(tmp_path):
    block = Half()
    x = torch.randn(1, 3, 16)
    with torch.inference_mode():
        prepared(tmp_path, block)
        block.inputs(x)
    (artefact,) = tmp_path.rglob("*.pt")
    artefact.write_bytes(b"not an artefact")
    torch._dynamo.reset()
    with torch.inference_mode():
        methods = prepared(tmp_path, block)
        torch.testing.assert_close(block.inputs(x), Half.inputs(block, x))
    assert methods.counts() == {"loaded": 0, "compiled": 1}
    with torch.inference_mode():
        assert prepared(tmp_path, block).counts() == {"loaded": 0, "compiled": 0}
        block.inputs(x)
    assert artefact.read_bytes() != b"not an artefact"


def test_a_method_with_a_graph_break_compiles_where_called(tmp_path, caplog):
    block = Half()
    with caplog.at_level(logging.WARNING, logger="stream_recon.models.builds.compilation"), torch.inference_mode():
        methods = prepared(tmp_path, block, names=("branchy",))
        for sign in (1, -1):
            x = torch.full((2, 3), float(sign))
            torch.testing.assert_close(block.branchy(x), Half.branchy(block, x))
    assert methods.counts() == {"loaded": 0, "compiled": 0}
    assert "no ahead-of-time artefact" in caplog.text
    assert not list(tmp_path.rglob("*.pt"))


def test_without_a_folder_artefacts_stay_in_memory(tmp_path):
    block = Half()
    x = torch.randn(1, 3, 16)
    with torch.inference_mode():
        methods = prepared(None, block)
        torch.testing.assert_close(block.inputs(x), Half.inputs(block, x))
    assert methods.counts() == {"loaded": 0, "compiled": 1}


def test_the_call_signature_tells_apart_what_compiled_code_depends_on():
    block, wider = Half(16), Half(32)
    x = torch.randn(1, 3, 16)
    same = call_signature((block, x))
    assert same == call_signature((Half(16), torch.randn(1, 3, 16)))
    assert same != call_signature((wider, x))
    assert same != call_signature((block, torch.randn(1, 4, 16)))
    assert same != call_signature((block, x.double()))
    assert same != call_signature((block, torch.randn(1, 16, 3).transpose(1, 2)))
    with torch.inference_mode():
        assert same != call_signature((block, x))
    with torch.autocast("cpu", torch.bfloat16):
        assert same != call_signature((block, x))


def test_the_artefact_folder_is_per_environment(tmp_path, monkeypatch):
    methods = CompiledMethods(tmp_path, torch.device("cpu"))
    assert methods.root.parent == tmp_path
    monkeypatch.setattr(compilation, "source_digest", lambda: "another source")
    assert CompiledMethods(tmp_path, torch.device("cpu")).root != methods.root


def test_the_source_digest_reads_every_module_of_models_and_cache(monkeypatch):
    """The rooms' modules (models/network/ and the rest) count, not only those at models/'s top."""
    repo = Path(__file__).resolve().parents[1]
    read = []
    read_bytes = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda path: read.append(path) or read_bytes(path))
    compilation.source_digest.cache_clear()
    try:
        compilation.source_digest()
    finally:
        compilation.source_digest.cache_clear()
    expected = {path for folder in ("models", "cache") for path in (repo / folder).rglob("*.py")}
    assert repo / "models" / "network" / "gct.py" in expected and set(read) == expected


def test_the_artefact_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("STREAM_RECON_COMPILED", str(tmp_path))
    assert artefacts_dir() == tmp_path
    monkeypatch.setenv("STREAM_RECON_COMPILED", "~/kept")
    assert artefacts_dir() == tmp_path.home() / "kept"
    monkeypatch.setenv("STREAM_RECON_COMPILED", "")
    assert artefacts_dir() is None
    monkeypatch.delenv("STREAM_RECON_COMPILED")
    assert artefacts_dir() is None


@pytest.mark.slow
def test_a_tiny_model_streams_the_same_from_loaded_artefacts(tiny_model, tmp_path):
    """Every compiled part of a prepared model (block halves, both heads) kept under a folder: a second
    preparation loads each call and compiles none, and both stream what the uncompiled model does."""
    import numpy as np

    from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference
    from stream_recon.models.builds.prepare import compile_blocks, compile_camera_head, compile_depth_head

    torch.manual_seed(0)
    frames = [torch.rand(3, 56, 70) for _ in range(5)]

    def stream(methods: CompiledMethods | None):
        model = prepare_for_inference(tiny_model, "cpu", torch.float32)  # (the CPU compiles nothing itself)
        if methods is not None:
            compile_blocks(model, methods)
            compile_depth_head(model, methods)
            compile_camera_head(model, methods)
        engine = StreamingEngine(model, StreamConfig(scale_frames=2, window=3))
        return [p for frame in frames for p in engine.push(frame)] + engine.finish()

    uncompiled = stream(None)
    first = CompiledMethods(tmp_path, torch.device("cpu"))
    compiled = stream(first)
    torch._dynamo.reset()
    second = CompiledMethods(tmp_path, torch.device("cpu"))
    loaded = stream(second)
    assert first.counts()["compiled"] >= 8 and first.counts()["loaded"] == 0
    assert second.counts() == {"loaded": first.counts()["compiled"], "compiled": 0}
    for reference, ours, theirs in zip(uncompiled, compiled, loaded, strict=True):
        np.testing.assert_array_equal(ours.depth, theirs.depth)
        np.testing.assert_array_equal(ours.c2w, theirs.c2w)
        np.testing.assert_allclose(ours.depth, reference.depth, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(ours.c2w, reference.c2w, rtol=1e-4, atol=1e-5)


def test_the_records_live_in_inductors_cache_folder_by_its_own_rule(monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert compilation.records_folder() == compilation.Path(default_cache_dir()) / compilation.RECORDS_FOLDER
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/inductor")
    assert str(compilation.records_folder()) == f"/somewhere/inductor/{compilation.RECORDS_FOLDER}"


# An uncompiled stream in a process of its own: its records looked up, scale step and streaming steps run,
# and the operators for compiled code called eagerly.
_UNCOMPILED_PROCESS = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from conftest import build_tiny_model
from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference
from stream_recon.models.builds.compilation import recorded
recorded("0" * 32, "compiled")
engine = StreamingEngine(prepare_for_inference(build_tiny_model(), compile=False), StreamConfig(scale_frames=2, window=2))
for _ in range(4):
    engine.push(torch.rand(3, 28, 42))
engine.finish()
from stream_recon.models.network import few_token_linear, fused_gelu
x, weight, bias = torch.rand(2, 8), torch.rand(16, 8), torch.rand(16)
fused_gelu._linear_gelu_epilogue(x, weight, bias)  # the operators' eager calls
few_token_linear._few_token_linear_op(x, weight.half(), bias, True)
print(sorted(name for name in ("torch._dynamo", "torch._inductor") if name in sys.modules))
"""


@pytest.mark.slow
def test_an_uncompiled_stream_never_imports_the_compiler():
    """Dynamo and Inductor cost 1.0-1.5 s to import on a fresh machine: a process that compiles nothing
    does not import them, neither for the records' folder nor to keep its scale steps eager."""
    import subprocess
    import sys
    from pathlib import Path

    tests = str(Path(__file__).parent)
    result = subprocess.run([sys.executable, "-c", _UNCOMPILED_PROCESS, tests], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_an_operator_for_compiled_code_is_the_operator_only_under_torch_compile():
    """Eager calls run the function itself (an operator's first call imports Dynamo); compiled code calls
    the operator, whose fake gives Inductor the output's shape."""
    calls = []

    def doubled_like(x):
        return torch.empty_like(x)

    @operator_for_compiled_code("stream_recon_tests::doubled", doubled_like)
    def doubled(x: torch.Tensor) -> torch.Tensor:
        calls.append(torch.compiler.is_compiling())
        return x * 2

    x = torch.arange(4.0)
    assert torch.equal(doubled(x), x * 2) and calls == [False]
    torch._dynamo.reset()
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(lambda value: doubled(value) + 1, backend=backend, fullgraph=True)
    assert torch.equal(compiled(x), x * 2 + 1)
    assert "stream_recon_tests.doubled" in str(graphs[0].graph)  # the operator, not the traced function
