import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

# Golden helpers live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))
from golden_utils import GOLDEN, full_size_model  # noqa: E402

# Float32 everywhere: TF32 would break the golden tolerance (fixtures README §5).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="session")
def gpu_model():
    """The full-size model on deterministic weights as loaded (float32, on the host): each GPU test
    prepares its own copy for the device and precision it runs (prepare_for_inference)."""
    return full_size_model()


@pytest.fixture(scope="session")
def golden_checkpoint(tmp_path_factory) -> Path:
    """The fixtures' weights as an official-format .pt file (a bare state dict)."""
    path = tmp_path_factory.mktemp("checkpoint") / "synthetic-lingbot-map.pt"
    torch.save(full_size_model().state_dict(), path)
    return path


@pytest.fixture(scope="session")
def golden_frame_folder(tmp_path_factory) -> Path:
    """The 14 golden inputs as PNG files: at width 224 the preprocessing is the identity (fixtures §2)."""
    folder = tmp_path_factory.mktemp("golden_frames")
    images = np.load(GOLDEN / "inputs" / "preprocessed.npz")["images_u8"]  # [14, 3, H, W] RGB
    for index, image in enumerate(images):
        cv2.imwrite(str(folder / f"{index:06d}.png"), cv2.cvtColor(image.transpose(1, 2, 0), cv2.COLOR_RGB2BGR))
    return folder

