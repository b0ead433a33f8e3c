"""Our Triton kernels built in child processes (models/builds/kernel_builders.py): real children, each asked to build a
stand-in kernel (tests/kernel_stand_ins.py: Triton builds CUDA kernels only where a GPU is), and what the parent does
when one fails, dies or stalls; the dry pass's use of them (models/builds/kernel_builds.py)."""

from __future__ import annotations

import json
import logging
import os
import time
import types
from pathlib import Path

import pytest
import torch
from helpers import warnings_of
from kernel_stand_ins import kernel

from stream_recon.models.builds import kernel_builders, kernel_builds
from stream_recon.models.supervision import Helper

TESTS = Path(__file__).parent


@pytest.fixture
def builders_helper(monkeypatch):
    """A fresh process-wide helper of the child builders, for this test."""
    helper = Helper(kernel_builders.KERNEL_BUILDERS)
    monkeypatch.setattr(kernel_builds.PROCESS, "children", helper)
    return helper


@pytest.fixture
def builders(builders_helper):
    """Two children that can import the stand-in kernel; closed at the test's end."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    made = kernel_builders.KernelBuilders(2, None, builders_helper, env=env)
    yield made
    made.close()


def order(do: str, path: Path | None = None) -> str:
    return json.dumps({"do": do, "path": str(path)})


@pytest.mark.slow
def test_a_child_builds_the_kernel_it_is_asked_for_and_ends_with_close(builders, builders_helper, tmp_path):
    assert builders.build(kernel, order("build", tmp_path / "a"))
    assert builders.build(kernel, order("build", tmp_path / "b"))
    builders_pids = {int(line) for name in "ab" for line in (tmp_path / name).read_text().split()}
    assert os.getpid() not in builders_pids and builders.built == 2 and builders_helper.is_up
    children = list(builders._children)
    builders.close()
    assert children and all(child.process.poll() is not None for child in children)
    assert not builders.build(kernel, order("build", tmp_path / "c"))  # closed: the caller builds it
    assert not (tmp_path / "c").exists()


@pytest.mark.slow
def test_a_build_a_child_reports_failed_is_left_to_the_caller_and_the_children_stay_on(builders, builders_helper,
                                                                                        tmp_path):
    assert not builders.build(kernel, order("fail"))
    assert builders_helper.is_up and builders.build(kernel, order("build", tmp_path / "a"))


def test_a_kernel_defined_inside_a_function_is_never_sent_to_a_child(builders, tmp_path):
    def local_kernel():
        pass

    local = types.SimpleNamespace(fn=local_kernel, preload=kernel.preload)
    assert kernel_builders.importable_name(local) is None
    assert kernel_builders.importable_name(kernel) == ("kernel_stand_ins", "kernel")
    assert not builders.build(local, order("build", tmp_path / "a")) and not (tmp_path / "a").exists()


@pytest.mark.slow
def test_a_child_that_dies_turns_the_children_off_with_one_warning(builders, builders_helper, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    assert not builders.build(kernel, order("die"))
    assert builders_helper.down_reason.startswith("a child building kernel died (exit code")
    assert not builders.build(kernel, order("build", tmp_path / "a"))  # off: the caller builds every later one
    assert not (tmp_path / "a").exists() and all(child.process.poll() is not None for child in builders._children)
    assert warnings_of(caplog) == [f"building kernels in child processes is off for the rest of the run: "
                                   f"{builders_helper.down_reason}"]


@pytest.mark.slow
def test_a_child_that_stalls_is_given_up_at_its_deadline_and_ended(builders, builders_helper, monkeypatch, tmp_path):
    assert builders.build(kernel, order("build", tmp_path / "started"))  # both children's imports are not timed
    assert builders.build(kernel, order("build", tmp_path / "started"))
    monkeypatch.setattr(kernel_builders, "CHILD_BUILD_S", 1.0)
    stalled = list(builders._children)
    started = time.monotonic()
    assert not builders.build(kernel, order("stall"))
    assert time.monotonic() - started < 5.0
    assert builders_helper.down_reason == "a child building kernel did not answer within 1 s"
    assert all(child.process.poll() is not None for child in stalled)  # SIGKILL ends a stopped process


def test_children_see_only_the_parents_gpu():
    assert kernel_builders.child_environment(1, {})["CUDA_VISIBLE_DEVICES"] == "1"
    assert kernel_builders.child_environment(1, {"CUDA_VISIBLE_DEVICES": "4,6"})["CUDA_VISIBLE_DEVICES"] == "6"
    assert "CUDA_VISIBLE_DEVICES" not in kernel_builders.child_environment(None, {"PATH": "/bin"})


@pytest.mark.skipif(not kernel_builds.available(), reason="this Triton cannot list builds")
@pytest.mark.slow
def test_the_dry_pass_has_its_listed_builds_made_in_the_children_first_then_loads_them(builders, monkeypatch,
                                                                                       tmp_path):
    """A listed build goes to a child, then the pass's own thread builds it (on a GPU: a hit in Triton's cache)
    and loads it; the pass ends the children and counts their builds."""
    from triton.runtime.jit import JitFunctionInfo

    monkeypatch.setattr(kernel_builds.PROCESS, "ahead", Helper(kernel_builds.BUILDS_AHEAD))
    monkeypatch.setattr(kernel_builds.PROCESS, "builders", builders)
    path = tmp_path / "built"
    with kernel_builds.dry_launches(torch.device("cpu")) as report:
        skipped = kernel_builds._hook(key="k", repr="k", fn=JitFunctionInfo("kernel_stand_ins", "kernel", kernel),
                                      compile={"key": "k", "specialization_data": order("build", path)},
                                      is_manual_warmup=False, already_compiled=False)
    pids = [int(line) for line in path.read_text().split()]
    assert skipped is True and report.builds == 1 and report.in_children == 1
    assert pids[0] != os.getpid() and pids[1:] == [os.getpid()]  # the child's build, then this process's
    assert kernel_builds.PROCESS.builders is None and builders._closed


def test_builders_start_only_on_cuda_and_where_tritons_cache_holds_none_of_ours(monkeypatch, tmp_path):
    from stream_recon.cache.triton_attention import range_kernel_name

    monkeypatch.setattr(kernel_builds.PROCESS, "builders", None)
    kernel_builds.start_builders("cpu")
    assert kernel_builds.PROCESS.builders is None
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    import triton

    if getattr(getattr(triton, "knobs", None), "cache", None) is not None:
        monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    assert not kernel_builds.triton_cache_holds(range_kernel_name())
    (tmp_path / "0123abcd").mkdir()
    (tmp_path / "0123abcd" / f"{range_kernel_name()}.json").write_text("{}")
    assert kernel_builds.triton_cache_holds(range_kernel_name())


def test_a_child_makes_the_kernels_launcher_from_its_build_and_a_launcher_it_cannot_make_is_left_to_the_parent(
        monkeypatch):
    from triton.runtime import driver

    made = []

    class Launchers:
        @staticmethod
        def launcher_cls(src, metadata):
            if src == "no compiler":
                raise RuntimeError("no C compiler on this host")
            made.append((src, metadata))

    monkeypatch.setattr(driver, "_active", Launchers)  # (what `driver.active` returns once set)
    built = types.SimpleNamespace(src="the kernel's source", metadata={"name": "kernel"})
    kernel_builders._make_launcher(built)
    kernel_builders._make_launcher(types.SimpleNamespace(src="no compiler", metadata={}))
    assert made == [("the kernel's source", {"name": "kernel"})]
