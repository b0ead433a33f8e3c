"""The compile beside the stream (models/compilation.py): which version of a fused function runs, what
a step notes, and that a round compiled on its own thread leaves nothing to compile where the stream
calls the compiled version. Dynamo's `eager` backend compiles here (no C++ compiler on the CI machine);
the GPU runner's switch is tested in tests/test_gpu_fast_path.py."""

from __future__ import annotations

import threading

import pytest
import torch
from torch._dynamo.utils import counters

from stream_recon.models.compilation import Compilation, eager_functions


def dynamo_eager(function):
    return torch.compile(function, backend="eager", dynamic=False)


class Recorder:
    """A compile function that says which version ran, on which thread, in inference mode or not."""

    def __init__(self):
        self.compiled_calls: list[tuple[str, bool, tuple]] = []

    def __call__(self, function):
        def compiled(*args, **kwargs):
            shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
            self.compiled_calls.append((threading.current_thread().name, torch.is_inference_mode_enabled(), shapes))
            return function(*args, **kwargs)

        return compiled


def scaled_sum(x: torch.Tensor, y: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
    return (x * scale + y).relu()


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_a_fused_function_runs_compiled_unless_its_thread_asks_for_eager():
    recorder = Recorder()
    fused = Compilation(recorder).fuse(scaled_sum)
    x, y = torch.ones(2), torch.zeros(2)
    fused(x, y)
    assert len(recorder.compiled_calls) == 1
    with eager_functions():
        torch.testing.assert_close(fused(x, y), scaled_sum(x, y))
        seen = []
        other = threading.Thread(target=lambda: seen.append(fused(x, y)))  # the flag is this thread's
        other.start()
        other.join()
    assert len(recorder.compiled_calls) == 2 and recorder.compiled_calls[1][0] != threading.current_thread().name
    fused(x, y)
    assert len(recorder.compiled_calls) == 3  # compiled again after the block


def test_a_step_notes_each_signature_once_with_copies_of_its_arguments():
    compilation = Compilation(Recorder())
    fused = compilation.fuse(scaled_sum)
    collection = compilation.collect()
    x, y = torch.ones(3), torch.zeros(3)
    with eager_functions(collect_into=collection):
        fused(x, y)
        fused(torch.full((3,), 5.0), y)  # the same signature
        fused(x, y, scale=3.0)  # another keyword value
        fused(torch.ones(4), torch.zeros(4))  # another shape
    assert len(collection.keys) == len(collection.calls) == 3
    x.fill_(7.0)  # the stream may overwrite its tensors before the compile thread reads them
    noted = [args[0] for _, args, _, _ in collection.calls.values()]
    assert all(bool((value == 1.0).all()) for value in noted)


def test_start_compiles_on_its_own_thread_in_the_callers_state_and_knows_what_it_compiled():
    recorder = Recorder()
    compilation = Compilation(recorder)
    fused = compilation.fuse(scaled_sum)
    collection = compilation.collect()
    with torch.inference_mode(), eager_functions(collect_into=collection):
        fused(torch.ones(2), torch.ones(2))
    assert recorder.compiled_calls == []  # eager: nothing compiled on the stream's thread
    progress = compilation.start(collection)
    assert progress.wait(60) and progress.ready and not progress.failed
    assert recorder.compiled_calls == [("stream-recon-compile", True, ((2,), (2,)))]
    assert progress.seconds >= 0

    again = compilation.collect()  # a later stream of the same size: ready at once, nothing copied
    with torch.inference_mode(), eager_functions(collect_into=again):
        fused(torch.ones(2), torch.ones(2))
    assert again.calls == {} and compilation.start(again).ready
    assert len(recorder.compiled_calls) == 1

    bigger = compilation.collect()  # a new size compiles its own calls
    with eager_functions(collect_into=bigger):
        fused(torch.ones(5), torch.ones(5))
    assert compilation.start(bigger).wait(60)
    assert recorder.compiled_calls[-1] == ("stream-recon-compile", False, ((5,), (5,)))  # (not in inference mode)


def test_a_failed_compile_is_reported_and_never_ready():
    def broken(function):
        def compiled(*args, **kwargs):
            raise RuntimeError("no compiler here")

        return compiled

    compilation = Compilation(broken)
    fused = compilation.fuse(scaled_sum)
    collection = compilation.collect()
    with eager_functions(collect_into=collection):
        fused(torch.ones(2), torch.ones(2))
    progress = compilation.start(collection)
    assert progress.wait(60)
    assert progress.failed and not progress.ready


def test_after_a_round_the_stream_thread_finds_dynamo_graphs_compiled_for_its_calls():
    """The property the runner's switch relies on: a call compiled on the round's thread is not
    compiled again where the stream makes it, through another wrapper of the same function too."""
    torch._dynamo.reset()
    compilation = Compilation(dynamo_eager)
    first, second = compilation.fuse(scaled_sum), compilation.fuse(scaled_sum)
    collection = compilation.collect()
    x, y = torch.randn(8), torch.randn(8)
    with torch.inference_mode(), eager_functions(collect_into=collection):
        expected = first(x, y)
    before = unique_graphs()
    assert compilation.start(collection).wait(120)
    compiled = unique_graphs()
    assert compiled > before  # the round compiled
    with torch.inference_mode():
        torch.testing.assert_close(first(x, y), expected)
        torch.testing.assert_close(second(x, y), expected)
    assert unique_graphs() == compiled  # and the stream's calls compiled nothing


@pytest.mark.parametrize("value", [torch.ones(2, 3).t(), [torch.ones(1), 2, "a"], {"k": torch.zeros(2)}])
def test_notes_copy_nested_arguments(value):
    compilation = Compilation(Recorder())
    fused = compilation.fuse(lambda v: v)
    collection = compilation.collect()
    with eager_functions(collect_into=collection):
        fused(value)
    (_, (copied,), _, _), = collection.calls.values()
    assert type(copied) is type(value)


def test_an_object_argument_is_described_by_its_attributes_not_its_identity_or_values():
    """A RoPE table is a new object every step, its values the frame's positions: one signature."""
    from stream_recon.models.rope import Rope3D

    def rotated(x, rope):
        return x * rope.cos_full[:, :1]

    compilation = Compilation(Recorder())
    fused = compilation.fuse(rotated)
    collection = compilation.collect()
    with eager_functions(collect_into=collection):
        for time_index in range(3):
            angles = torch.arange(4.0)[:, None] * (time_index + 1) * torch.ones(1, 8)
            fused(torch.ones(4, 1), Rope3D(angles.cos(), angles.sin()))
    assert len(collection.keys) == len(collection.calls) == 1
    (_, (_, copied_rope), _, _), = collection.calls.values()
    assert isinstance(copied_rope, Rope3D) and copied_rope.cos_full.shape == (4, 16)


@pytest.mark.parametrize("view", [lambda t: t[:, 1], lambda t: t.t(), lambda t: t[:1].expand(3, 4), lambda t: t[1:]])
def test_a_noted_tensor_keeps_the_sizes_and_strides_dynamo_guards_on(view):
    compilation = Compilation(Recorder())
    fused = compilation.fuse(lambda v: v)
    collection = compilation.collect()
    original = view(torch.arange(12.0).reshape(3, 4))
    with eager_functions(collect_into=collection):
        fused(original)
    (_, (copied,), _, _), = collection.calls.values()
    assert copied.shape == original.shape and copied.stride() == original.stride()
    torch.testing.assert_close(copied, original)
    assert copied.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()


def test_each_call_compiles_in_the_inference_and_autocast_state_it_was_made_in():
    """The camera head runs float32 (autocast off) inside a bf16 step: one function in two states,
    each compiled as the stream will call it."""
    seen = []

    def spy(function):
        def compiled(*args):
            seen.append((torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
                         torch.is_autocast_enabled("cuda")))
            return function(*args)

        return compiled

    compilation = Compilation(spy)
    fused = compilation.fuse(scaled_sum)
    collection = compilation.collect()
    with eager_functions(collect_into=collection):
        fused(torch.ones(2), torch.ones(2))
        with torch.inference_mode():
            fused(torch.ones(2), torch.ones(2))
    assert len(collection.calls) == 2
    assert compilation.start(collection).wait(60)
    assert sorted(seen) == [(False, False, False), (True, False, False)]
