"""A tiny stand-in for the sky network (skyseg.onnx needs the network to fetch): an ONNX model of the real
one's interface, [1, 3, 320, 320] ImageNet-normalised RGB in, a [1, 1, 320, 320] sky score out, built with
the onnx package. Its score is sigmoid(GAIN * (2 b - r - g)) on the normalised channels: blue sky near 1,
green and red ground near 0, a saturated step like the real network's."""

from __future__ import annotations

from pathlib import Path

import numpy as np

GAIN = 10.0


def write_tiny_skyseg(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = GAIN * np.array([-1.0, -1.0, 2.0], dtype=np.float32).reshape(1, 3, 1, 1)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["input", "weight"], ["logit"]), helper.make_node("Sigmoid", ["logit"], ["score"])],
        "tiny_skyseg",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, 320, 320])],
        [helper.make_tensor_value_info("score", TensorProto.FLOAT, [1, 1, 320, 320])],
        [numpy_helper.from_array(weight, "weight")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8  # what every onnxruntime since 1.14 reads
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def sky_and_ground(height: int, width: int, horizon: float = 0.4, seed: int = 0) -> np.ndarray:
    """[H, W, 3] uint8 RGB: blue sky above `horizon` (a share of the height), textured green and red below."""
    rng = np.random.default_rng(seed)
    image = np.empty((height, width, 3), np.uint8)
    rows = int(horizon * height)
    image[:rows] = (40, 90, 235) + rng.integers(-10, 10, (rows, width, 3))
    ground = np.where(rng.random((height - rows, width, 1)) < 0.5, (60, 170, 50), (170, 60, 40))
    image[rows:] = np.clip(ground + rng.integers(-15, 15, (height - rows, width, 3)), 0, 255)
    return image
