"""`--compile auto`: the records of compiled sizes, the choice a run makes from them, and the child
process that compiles a size beside a run (models/builds/compile_child.py, models/builds/compilation.py).

On this machine the child runs for real on the CPU with the tiny model (prepare_for_inference does not
compile off CUDA, so it exercises the process, its key, its warm-up and its record, not Inductor);
tests/test_gpu_fast_path.py checks on a GPU that its compile serves the next run's.
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from stream_recon.app.options import OptionsError, RunOptions
from stream_recon.app.run.loading import chunk_engine_config
from stream_recon.models import ModelConfig
from stream_recon.models.builds.compilation import (
    compiled_code_key,
    matmul_settings,
    record,
    recorded,
    records_folder,
)
from stream_recon.models.builds.compile_child import CompiledSizes
from stream_recon.models.builds.plan import BuildSettings, compile_choice, run_key

SIZE = (56, 70)  # (height, width) of the tiny model's frames here: 4 x 5 patches


@pytest.fixture(autouse=True)
def inductor_cache(tmp_path, monkeypatch):
    """Each test's compile caches (and so its records) in a folder of its own."""
    folder = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
    return folder


def options(**overrides) -> RunOptions:
    return RunOptions(**{"scale_frames": 2, "window": 4, "chunk_frames": 16, "overlap": 4, "viewer": False,
                         "image_width": SIZE[1], **overrides})


def key_for(run_options: RunOptions, size=SIZE, dtype=torch.float32, config=None) -> str:
    config = config or ModelConfig.tiny()
    return compiled_code_key(config, chunk_engine_config(run_options, config), size, dtype, torch.device("cpu"))


def test_the_compile_option_takes_auto_on_off_and_the_booleans_of_earlier_settings():
    assert RunOptions().compile == "auto"
    assert (RunOptions(compile=True).compile, RunOptions(compile=False).compile) == ("on", "off")
    with pytest.raises(OptionsError, match="--compile must be one of auto, on, off"):
        RunOptions(compile="sometimes")


def test_records_live_in_inductors_cache_folder_and_name_one_key_each(inductor_cache):
    assert records_folder() == inductor_cache / "stream-recon-compiled"
    assert not recorded("a" * 32, "compiled")
    record("a" * 32, "compiled", "note")
    assert recorded("a" * 32, "compiled")
    assert not recorded("a" * 32, "compile-first") and not recorded("b" * 32, "compiled")
    assert (inductor_cache / "stream-recon-compiled" / f"{'a' * 32}.compiled").read_text() == "note\n"


@pytest.mark.slow
def test_the_key_names_the_size_precision_settings_and_architecture_and_is_the_same_in_another_process():
    base = key_for(options())
    assert len(base) == 32 and base == key_for(options())
    others = [key_for(options(), size=(70, 70)), key_for(options(), dtype=torch.bfloat16),
              key_for(options(window=3)), key_for(options(chunk_frames=17)), key_for(options(kv_cache="fp8")),
              key_for(options(), config=ModelConfig.from_name("lingbot-map"))]
    assert len({base, *others}) == 1 + len(others)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:  # Inductor's cache keys name the matrix products' precision flags: so does ours
        torch.backends.cuda.matmul.allow_tf32 = not tf32
        assert key_for(options()) != base
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    # options that change nothing the step compiles leave it alone
    assert key_for(options(conf_threshold=3.0, port=9000, keyframes="all")) == base
    # another process with this one's precision flags (conftest turns TF32 off here) names the same key
    code = ("import json, sys, torch; from stream_recon.models import ModelConfig; from stream_recon.app.options "
            "import RunOptions; from stream_recon.app.run.loading import chunk_engine_config; from stream_recon.models.builds."
            "compilation import compiled_code_key, use_matmul_settings; use_matmul_settings(json.loads(sys.argv[1]));"
            " o = RunOptions(scale_frames=2, window=4, chunk_frames=16, overlap=4, viewer=False, image_width=70); "
            "c = ModelConfig.tiny(); print(compiled_code_key(c, chunk_engine_config(o, c), (56, 70), torch.float32, "
            "torch.device('cpu')))")
    assert subprocess.run([sys.executable, "-c", code, json.dumps(matmul_settings())], capture_output=True, text=True,
                          check=True).stdout.strip() == base


def test_auto_compiles_what_was_compiled_or_must_compile_first_and_compiles_a_new_size_beside_the_run():
    key = key_for(options())
    assert compile_choice("auto", "cuda", key) == (choice := compile_choice("auto", "cuda:0", key))
    assert (choice.compile, choice.beside) == (False, True)
    assert compile_choice("auto", "cuda", None).compile  # size unknown before the first frame: as before
    assert compile_choice("auto", "cuda", key, warm_up="off").compile  # no warm-up for a child to follow
    assert compile_choice("on", "cuda", key).compile and not compile_choice("on", "cuda", key).beside
    assert not compile_choice("off", "cuda", key).compile
    assert not compile_choice("auto", "cpu", key).compile and not compile_choice("on", "cpu", key).compile
    record(key, "compile-first")
    assert compile_choice("auto", "cuda", key).compile
    other = key_for(options(window=3))
    record(other, "compiled")
    assert compile_choice("auto", "cuda", other) == compile_choice("on", "cuda", other)
    assert run_key(BuildSettings("auto", "auto", None, 2, "cpu", torch.float32, ModelConfig.tiny(), None, SIZE)) is None
    assert run_key(BuildSettings("auto", "auto", None, 2, "cuda", torch.float32, ModelConfig.tiny(), None, None)) is None


def compiled_sizes(prepared_tiny_model, run_options: RunOptions, beside: bool = True) -> CompiledSizes:
    config = chunk_engine_config(run_options, prepared_tiny_model.config)
    return CompiledSizes(run_options.gpu_memory, prepared_tiny_model, "cpu", torch.float32, config, beside=beside)


def wait_for(sizes: CompiledSizes, timeout_s: float = 240.0) -> str:
    deadline = time.monotonic() + timeout_s
    while sizes.poll() == "compiling" and time.monotonic() < deadline:
        time.sleep(0.2)
    return sizes.poll()


@pytest.mark.slow
def test_a_new_size_is_compiled_by_a_child_process_that_leaves_its_record(prepared_tiny_model):
    run_options = options()
    sizes = compiled_sizes(prepared_tiny_model, run_options)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:  # the child takes the run's precision flags (its key would differ otherwise, and it would refuse)
        torch.backends.cuda.matmul.allow_tf32 = not tf32
        note = sizes.warmed_up(SIZE)
        key = key_for(run_options)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    assert "not in this machine's caches" in note and "background process compiles it" in note
    assert sizes.key == key and sizes.process is not None
    assert (records_folder() / f"{key}.compiling").read_text().strip() == str(sizes.process.pid)
    assert wait_for(sizes) == "done", (records_folder() / f"{key}.log").read_text()
    assert recorded(key, "compiled")
    done = json.loads((records_folder() / f"{key}.compiled").read_text())
    assert done["size"] == list(SIZE) and set(done["warm_up"]) == {"scale_step_s", "streaming_steps_s"}
    assert not (records_folder() / f"{key}.compiling").exists()  # the child's lock went with it
    assert sizes.summary()["status"] == "done" and sizes.summary()["key"] == key
    assert sizes.finish(stop=False) is None  # nothing left to say at the run's end
    assert compile_choice("auto", "cuda", key).compile  # the next run of this size compiles


@pytest.mark.slow
def test_a_run_stopped_by_a_signal_stops_its_compile_and_one_that_ends_lets_it_finish(prepared_tiny_model):
    stopped = compiled_sizes(prepared_tiny_model, options())
    stopped.warmed_up(SIZE)
    assert stopped.finish(stop=True) is None
    assert stopped.process.returncode is not None and stopped.summary()["status"] == "stopped with the run"
    with pytest.raises(ProcessLookupError):  # its whole process group is gone
        os.killpg(stopped.process.pid, 0)
    assert not recorded(stopped.key, "compiled")

    ended = compiled_sizes(prepared_tiny_model, options(window=3))
    ended.warmed_up(SIZE)
    note = ended.finish(stop=False)
    assert f"process {ended.process.pid}" in note and ended.summary()["status"] == "finishing after the run"
    ended.process.wait(240)
    assert recorded(ended.key, "compiled")


@pytest.mark.slow
def test_a_size_being_compiled_by_another_process_is_not_compiled_twice(prepared_tiny_model):
    run_options = options()
    key = key_for(run_options)
    records_folder().mkdir(parents=True)
    (records_folder() / f"{key}.compiling").write_text(f"{os.getpid()}\n")  # a live process holds it
    sizes = compiled_sizes(prepared_tiny_model, run_options)
    assert "being made by another process" in sizes.warmed_up(SIZE)
    assert sizes.process is None and sizes.summary()["status"] == "already compiling"
    (records_folder() / f"{key}.compiling").write_text("999999999\n")  # a lock its process left behind
    again = compiled_sizes(prepared_tiny_model, run_options)
    assert "background process" in again.warmed_up(SIZE)
    assert wait_for(again) == "done"


def test_no_room_beside_the_run_is_recorded_so_the_next_run_compiles_first(prepared_tiny_model, monkeypatch):
    import stream_recon.models.builds.compile_child as compile_child

    # the device's free memory cannot be made small for real here: the query is the one stand-in
    monkeypatch.setattr(compile_child, "_free_bytes", lambda device: 1 << 20)
    sizes = compiled_sizes(prepared_tiny_model, options())
    note = sizes.warmed_up(SIZE)
    assert "needs" in note and "the next run of this size compiles before its first frame" in note
    assert sizes.process is None and sizes.summary()["status"] == "no room"
    assert recorded(sizes.key, "compile-first") and compile_choice("auto", "cuda", sizes.key).compile


def test_a_compiled_run_records_its_size_and_starts_nothing(prepared_tiny_model, monkeypatch):
    sizes = compiled_sizes(prepared_tiny_model, options(), beside=True)
    monkeypatch.setattr(prepared_tiny_model, "inference_spec",
                        prepared_tiny_model.inference_spec.__class__(
                            **{**vars(prepared_tiny_model.inference_spec), "compiled": True}))
    assert sizes.warmed_up(SIZE) is None
    assert sizes.process is None and recorded(sizes.key, "compiled")
    assert sizes.summary()["status"] == "compiled by the run"


def test_a_memory_budget_counts_the_background_compile(prepared_tiny_model):
    """--gpu-memory is the whole run's: a child whose estimate does not fit in what the budget leaves is
    not started (here the tiny model's child needs more than 1 GiB: its context's allowance alone)."""
    sizes = compiled_sizes(prepared_tiny_model, options(gpu_memory="1GiB"))
    note = sizes.warmed_up(SIZE)
    assert "left of --gpu-memory beside the run" in note and sizes.process is None
    assert recorded(sizes.key, "compile-first")


@pytest.mark.slow
def test_the_child_streams_with_the_runs_memory_plan_under_the_runs_key(prepared_tiny_model):
    """Under --gpu-memory the run's engine takes its plan's K/V precision and window; the child's does too
    (as a spare engine does: no budget of its own), and its record is the run's key."""
    from types import SimpleNamespace

    from stream_recon.models.builds.compile_child import planned

    run_options = options(gpu_memory="64GiB")
    config = chunk_engine_config(run_options, prepared_tiny_model.config)
    assert planned(config, None) is config
    assert (planned(config, {"kv_cache": "auto", "window": 3}).window,
            planned(config, {"kv_cache": "auto", "window": 3}).gpu_memory) == (3, None)
    sizes = compiled_sizes(prepared_tiny_model, run_options)
    assert "background process" in sizes.warmed_up(SIZE, SimpleNamespace(kv_cache="auto", window=3))
    assert wait_for(sizes) == "done", (records_folder() / f"{sizes.key}.log").read_text()
    assert sizes.key == key_for(run_options) and recorded(sizes.key, "compiled")


@pytest.mark.slow
def test_a_child_that_fails_says_so_and_the_next_run_compiles_first(prepared_tiny_model):
    """A child whose work fails (here: the key it is handed is not the one the run's settings name) exits
    non-zero with a record that makes the next run of that key compile before its stream; the run says
    so at its end."""
    sizes = compiled_sizes(prepared_tiny_model, options())
    sizes.key = "f" * 32
    sizes._start(SIZE)
    status = wait_for(sizes)
    assert status.startswith("failed (exit 1; its log: ")
    assert "differs from the run's" in (records_folder() / f"{'f' * 32}.log").read_text()
    assert recorded("f" * 32, "compile-first") and compile_choice("auto", "cuda", "f" * 32).compile
    assert "differs from the run's" in (records_folder() / f"{'f' * 32}.compile-first").read_text()
    assert "the next run of this size compiles first" in sizes.finish(stop=False)


def test_the_hosts_room_for_a_cpu_child_counts_its_reclaimable_page_cache(tmp_path, monkeypatch):
    """A CPU child's room is the host's MemAvailable, never the smaller MemFree (near zero once the page
    cache has filled, as on a busy CI machine: the child was then refused as if the host had no memory)."""
    from stream_recon.models.builds import compile_child

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:           51200 kB\nMemAvailable:   20000000 kB\n"
                       "Buffers:          10000 kB\n")
    monkeypatch.setattr(compile_child, "MEMINFO", str(meminfo))
    assert compile_child._free_bytes(torch.device("cpu")) == 20000000 * 1024
