"""Shared test fixtures.

For a test that runs the tiny model:

    pytestmark = pytest.mark.usefixtures("one_torch_thread")   # the module's torch on one thread

    def test_something(tiny_model): ...                         # ModelConfig.tiny(), synthetic weights

and `build_tiny_model()` where a plain function is needed (a Ray worker's loader, a checkpoint to save).
"""

import sys
from pathlib import Path

import pytest
import torch

from stream_recon.models import GCTStream, ModelConfig
from stream_recon.models.synthetic import load_synthetic_weights

# Golden helpers live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))

# Float32 everywhere: TF32 would break the golden tolerance (fixtures README §5).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def build_tiny_model(config: ModelConfig | None = None) -> GCTStream:
    """The tiny model (`config`, default ModelConfig.tiny()) with the deterministic synthetic weights, in
    eval mode on the CPU: every caller, process and Ray worker gets the same numbers."""
    return load_synthetic_weights(GCTStream(config or ModelConfig.tiny())).eval()


@pytest.fixture(scope="module")
def tiny_model() -> GCTStream:
    """One tiny model per test module (see build_tiny_model)."""
    return build_tiny_model()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one intra-op thread for the rest of the module, then back to what it was.

    The tiny model's ops take microseconds: two OpenMP threads on a busy 2-core machine only wait on
    each other and a run gets ~15x slower. One thread also matches Ray workers, which run torch on one
    thread, so in-process and distributed results compare number for number.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def gpu_model():
    """The full-size model on deterministic weights, on the GPU (the GPU tests share one copy)."""
    from golden_utils import full_size_model

    model = full_size_model().cuda()
    # A bf16 engine converts the model in place (lossy); the helpers restore these before each run.
    model.fp32_state = {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}
    return model
