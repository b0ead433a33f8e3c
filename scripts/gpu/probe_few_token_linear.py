"""Which kernel reads the camera head's one-token linear layers fastest? cuBLAS in float32 (the
layers as the reference runs them), cuBLAS in bfloat16 (a lower bound for half-precision reads) and
our float16-weight kernel (stream_recon.models.few_token_linear) over a sweep of its tile sizes.

Each timed call reads a different copy of the weights (more bytes than L2 holds), as the camera
head's 16 blocks do, and the calls are replayed from a CUDA graph, as in the engine. Prints a table
and writes JSON (--json).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from stream_recon.models.few_token_linear import few_token_linear

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import graph_time_us  # noqa: E402

# (name, outputs, inputs) of the camera head's layers at the checkpoints' width (2C = 2048).
SHAPES = [("qkv", 6144, 2048), ("proj", 2048, 2048), ("fc1", 8192, 2048), ("fc2", 2048, 8192),
          ("modulation", 6144, 2048)]
COPIES = 12  # > 50 MB of L2 for every shape


def probe_shape(outputs: int, inputs: int, tokens: int, configs) -> dict:
    weights = [torch.randn(outputs, inputs, device="cuda") / inputs**0.5 for _ in range(COPIES)]
    bias = torch.randn(outputs, device="cuda")
    x = torch.randn(tokens, inputs, device="cuda")
    expected = F.linear(x.double(), weights[0].half().double(), bias.double())
    results = {"float32 cuBLAS": graph_time_us([lambda w=w: F.linear(x, w, bias) for w in weights])}
    halves = [w.half() for w in weights]
    del weights
    bf16 = [w.bfloat16() for w in halves]
    xb, bb = x.bfloat16(), bias.bfloat16()
    results["bfloat16 cuBLAS"] = graph_time_us([lambda w=w: F.linear(xb, w, bb) for w in bf16])
    del bf16
    for block_n, block_k, warps in configs:
        out = few_token_linear(x, halves[0], bias, block_outputs=block_n, block_inputs=block_k, num_warps=warps)
        error = ((out.double() - expected).abs().max() / expected.abs().max()).item()
        if error > 1e-5:
            raise AssertionError(f"{outputs}x{inputs} ({block_n}, {block_k}, {warps}): relative error {error:.2e}")
        kernel = functools.partial(few_token_linear, block_outputs=block_n, block_inputs=block_k, num_warps=warps)
        results[f"f16 kernel {block_n}x{block_k} w{warps}"] = graph_time_us(
            [functools.partial(kernel, x, w, bias) for w in halves])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    configs = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (2, 4, 8)))
    table = {}
    for name, outputs, inputs in SHAPES:
        table[name] = probe_shape(outputs, inputs, args.tokens, configs)
        f32_bytes = outputs * inputs * 4
        print(f"\n{name}: {outputs} x {inputs}, {args.tokens} token(s)")
        for kernel, us in sorted(table[name].items(), key=lambda item: item[1])[:8] + [
                (k, table[name][k]) for k in ("float32 cuBLAS", "bfloat16 cuBLAS")]:
            bytes_read = f32_bytes if kernel.startswith("float32") else f32_bytes // 2
            print(f"  {kernel:28s} {us:8.2f} us  {bytes_read / us / 1e3:7.0f} GB/s")
    # The configuration with the least total time over the camera head's per-frame mix of layers
    # (per iteration: 4 x (qkv, proj, fc1, fc2) + modulation).
    weight = {"qkv": 4, "proj": 4, "fc1": 4, "fc2": 4, "modulation": 1}
    totals = {k: sum(weight[n] * table[n][k] for n in table) for k in table["qkv"]}
    print("\nper refinement iteration (16 block layers + modulation), best first:")
    for kernel, us in sorted(totals.items(), key=lambda item: item[1])[:6]:
        print(f"  {kernel:28s} {us:8.1f} us  (x4 iterations: {4 * us / 1e3:.2f} ms per frame)")
    for kernel in ("float32 cuBLAS", "bfloat16 cuBLAS"):
        print(f"  {kernel:28s} {totals[kernel]:8.1f} us  (x4 iterations: {4 * totals[kernel] / 1e3:.2f} ms per frame)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "tokens": args.tokens, "layers": table,
                       "per_iteration_us": totals}, f, indent=1)


if __name__ == "__main__":
    main()
