"""A stand-in for the sky network of `--mask-sky` (skyseg.onnx, which the device machine cannot fetch): an
ONNX model of its interface ([1, 3, 320, 320] in, [1, 1, 320, 320] score out) and of about its cost, to
measure what masking costs a run's steady FPS (bench_e2e.py --mask-sky against without).

    python3 scripts/probes/skyseg_standin.py -o /tmp/skyseg/skyseg.onnx            # ~60 GFLOP a frame
    STREAM_RECON_CHECKPOINTS=/tmp/skyseg python3 scripts/bench_e2e.py --frames 600 --mask-sky --json sky.json

The body is a stack of 3x3 convolutions at 320 x 320 (`--channels` wide, enough layers for `--gflops`),
then a 1x1 convolution and a sigmoid: the work of a U-Net-sized segmenter at its input size, without its
weights. The default, 60 GFLOP (2 x multiply-adds), is of the order of the U^2-Net family the real file
comes from; check it against the real file's cost (onnx's shape inference, or a profile) where it can be
read, and pass --gflops to match.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

SIZE = 320


def build(path: Path, gflops: float, channels: int) -> tuple[int, float]:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    first = 2 * SIZE * SIZE * 3 * channels * 9 / 1e9  # the 3 -> channels 3x3 convolution
    per_layer = 2 * SIZE * SIZE * channels * channels * 9 / 1e9  # each channels -> channels one after it
    layers = 1 + max(0, math.ceil((gflops - first) / per_layer))
    rng = np.random.default_rng(0)
    nodes, weights, previous, width = [], [], "input", 3
    for index in range(layers):
        name = f"w{index}"
        scale = 1.0 / math.sqrt(9 * width)
        weights.append(numpy_helper.from_array((rng.standard_normal((channels, width, 3, 3)) * scale)
                                               .astype(np.float32), name))
        nodes.append(helper.make_node("Conv", [previous, name], [f"c{index}"], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"c{index}"], [f"r{index}"]))
        previous, width = f"r{index}", channels
    weights.append(numpy_helper.from_array((rng.standard_normal((1, channels, 1, 1)) * 0.1).astype(np.float32), "head"))
    nodes += [helper.make_node("Conv", [previous, "head"], ["logit"]), helper.make_node("Sigmoid", ["logit"], ["score"])]
    graph = helper.make_graph(nodes, "skyseg_standin",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, 3, SIZE, SIZE])],
                              [helper.make_tensor_value_info("score", TensorProto.FLOAT, [1, 1, SIZE, SIZE])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return layers, first + (layers - 1) * per_layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--output", type=Path, default=Path("/tmp/skyseg/skyseg.onnx"))
    parser.add_argument("--gflops", type=float, default=60.0, help="work per frame, 2 x multiply-adds")
    parser.add_argument("--channels", type=int, default=64)
    args = parser.parse_args()
    layers, gflops = build(args.output, args.gflops, args.channels)
    print(f"wrote {args.output}: {layers} 3x3 convolutions of {args.channels} channels at {SIZE}x{SIZE}, "
          f"{gflops:.1f} GFLOP a frame")


if __name__ == "__main__":
    main()
