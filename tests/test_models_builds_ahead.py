"""The warm-up's dry pass run while a checkpoint loads (models/builds/ahead.py): on its own thread, on a
zero model of the run's architecture, for one frame size; a failure leaves the warm-up its own dry pass.

Triton builds CUDA kernels only where a GPU is (tests/test_gpu_fast_path.py checks the real builds); here
the dry pass runs on the CPU, as in tests/test_models_kernel_builds.py: its steps run and list nothing."""

from __future__ import annotations

import threading

import pytest
import torch

from stream_recon.models import ModelConfig, StreamConfig, StreamingEngine
from stream_recon.models.builds import ahead as builds_ahead
from stream_recon.models.builds import kernel_builds

pytestmark = pytest.mark.skipif(not kernel_builds.available(), reason="this Triton cannot list builds")


@pytest.fixture
def dry_passes(monkeypatch) -> list[tuple[str, tuple[int, int], int]]:
    """Every dry pass made: (its thread, the engine's frame size, its window slots)."""
    passes = []
    run_dry = StreamingEngine.run_dry

    def recorded(engine, image, dry_pass):
        seconds = run_dry(engine, image, dry_pass)
        passes.append((threading.current_thread().name, engine.image_size, engine.window_slots))
        return seconds

    monkeypatch.setattr(StreamingEngine, "run_dry", recorded)
    return passes


def test_the_pass_runs_on_its_own_thread_for_the_size_it_was_given(dry_passes):
    ahead = builds_ahead.BuildsAhead(ModelConfig.tiny(), StreamConfig(scale_frames=3, window=4), (28, 42), "cpu",
                                     torch.float32)
    seconds = ahead.wait()
    assert dry_passes == [("kernel-build-ahead", (28, 42), 1)]
    assert seconds["kernel_builds"] == 0 and seconds["kernel_builds_s"] > 0
    assert seconds["kernel_builds_ahead_s"] >= seconds["kernel_builds_s"] and seconds["kernel_builds_ahead_wait_s"] >= 0
    assert ahead.covers((28, 42)) and ahead.covers(torch.Size([28, 42]))
    assert not ahead.covers((42, 28))  # a warm-up of another size makes its own dry pass


def test_a_pass_that_fails_says_so_and_covers_nothing(dry_passes, monkeypatch, caplog):
    def no_model(*args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(builds_ahead, "prepare_without_weights", no_model)
    ahead = builds_ahead.BuildsAhead(ModelConfig.tiny(), StreamConfig(scale_frames=3, window=4), (28, 42), "cpu",
                                     torch.float32)
    assert ahead.wait() is None and not ahead.covers((28, 42)) and not dry_passes
    assert "the warm-up builds them" in caplog.text and "out of memory" in caplog.text


def test_a_pass_pays_only_uncompiled_on_cuda():
    assert not kernel_builds.dry_pass_pays("cpu", compiled=False)
    assert not kernel_builds.dry_pass_pays("cuda", compiled=True)
