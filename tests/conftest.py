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
    """The full-size model on deterministic weights, on the GPU (the GPU tests share one copy)."""
    from golden_utils import full_size_model

    model = full_size_model().cuda()
    # A bf16 engine converts the model in place (lossy); the helpers restore these before each run.
    model.fp32_state = {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}
    return model
