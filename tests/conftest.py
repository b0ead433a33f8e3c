import sys
from pathlib import Path

import torch

# Golden helpers live beside the tests.
sys.path.insert(0, str(Path(__file__).parent))

# Float32 everywhere: TF32 would break the golden tolerance (fixtures README §5).
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
