"""Preparing a model for inference: once, explicitly, never converting the model it is given."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import build_tiny_model

from stream_recon.models import (
    ModelConfig,
    StreamConfig,
    StreamingEngine,
    load_model,
    prepare_for_inference,
)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A tiny model loaded from a real checkpoint file, as a user's model is."""
    path = tmp_path_factory.mktemp("checkpoint") / "tiny.pt"
    torch.manual_seed(0)
    torch.save(build_tiny_model().state_dict(), path)
    return load_model(path, config=ModelConfig.tiny())


def stream(model, frames):
    engine = StreamingEngine(model, StreamConfig(scale_frames=2, window=2, keyframes="interval:2"))
    return [p for frame in frames for p in engine.push(frame)] + engine.finish()


def frames(count=6):
    generator = torch.Generator().manual_seed(4)
    return [torch.rand(3, 28, 42, generator=generator) for _ in range(count)]


def test_preparing_leaves_the_given_model_as_it_was(loaded):
    before = {name: value.clone() for name, value in loaded.state_dict().items()}
    modules = [type(module) for module in loaded.modules()]
    prepared = prepare_for_inference(loaded, "cpu", torch.float32)
    stream(prepared, frames())
    assert prepared is not loaded and not hasattr(loaded, "inference_spec")
    assert [type(module) for module in loaded.modules()] == modules
    assert all(torch.equal(value, before[name]) for name, value in loaded.state_dict().items())
    assert not any(a is b for a, b in zip(prepared.modules(), loaded.modules(), strict=True))


def test_two_preparations_of_one_model_stream_identically(loaded):
    first, second = (stream(prepare_for_inference(loaded), frames()) for _ in range(2))
    assert [p.frame_type for p in first] == [p.frame_type for p in second]
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a.depth, b.depth)
        np.testing.assert_array_equal(a.pose_enc, b.pose_enc)


def test_the_engine_takes_only_a_model_prepared_for_its_device_and_precision(loaded):
    with pytest.raises(ValueError, match=r"takes a prepared model: call .*prepare_for_inference"):
        StreamingEngine(loaded, StreamConfig())
    prepared = prepare_for_inference(loaded)
    assert prepared.inference_spec.device == torch.device("cpu") and prepared.inference_spec.dtype == torch.float32
    assert not prepared.inference_spec.compiled  # never on the CPU
    with pytest.raises(ValueError, match="prepared for float32, not bfloat16"):
        StreamingEngine(prepared, StreamConfig(), dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="already prepared"):
        prepare_for_inference(prepared)


def test_half_precision_is_refused_on_the_cpu(loaded):
    with pytest.raises(ValueError, match="bfloat16 runs need a CUDA device"):
        prepare_for_inference(loaded, "cpu", torch.bfloat16)


def test_a_model_prepared_without_weights_is_the_loaded_one_prepared_but_zero(loaded):
    """The same modules, parameter names, shapes, dtypes and strides as the loaded checkpoint prepared for
    the same device and precision, with zero weights; its steps run (models/builds/ahead.py runs them)."""
    from stream_recon.models.builds.prepare import prepare_without_weights

    real = prepare_for_inference(loaded, "cpu", torch.float32)
    zero = prepare_without_weights(loaded.config, "cpu", torch.float32)
    assert [(name, type(m)) for name, m in zero.named_modules()] == [(name, type(m)) for name, m in real.named_modules()]
    described = [{name: (v.shape, v.dtype, v.stride(), v.device) for name, v in model.state_dict().items()}
                 for model in (zero, real)]
    assert described[0] == described[1]
    assert all(not value.any() for value in zero.state_dict().values())
    assert zero.inference_spec == real.inference_spec
    assert len(stream(zero, frames())) == 6


def test_a_model_without_weights_needs_the_device_to_prepare_it_for():
    with torch.device("meta"):
        from stream_recon.models.network.gct import GCTStream

        skeleton = GCTStream(ModelConfig.tiny())
    with pytest.raises(ValueError, match="meta device has no weights to place: pass the device"):
        prepare_for_inference(skeleton)
