import sys
from pathlib import Path

import pytest
import torch

# Golden helpers live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))

# Float32 everywhere: TF32 would break the golden tolerance (fixtures README §5).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="session")
def gpu_model():
    """The full-size model on deterministic weights as loaded (float32, on the host): each GPU test
    prepares its own copy for the device and precision it runs (prepare_for_inference)."""
    from golden_utils import full_size_model

    return full_size_model()
