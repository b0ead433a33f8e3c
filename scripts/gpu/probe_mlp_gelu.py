"""Can the MLP's first layer and its GELU be one kernel? At the streaming shape (1,005 tokens,
1024 -> 4096, bf16) cuBLAS takes ~15 us and the separate GELU ~8 us, 72 times per frame.

Candidates, each inside a CUDA graph that cycles through 8 weight copies (more than L2 holds, as
the model's 72 layers do): cuBLAS linear then GELU (eager kernels, and torch.compile'd as the
engine runs them), cuBLASLt's fused bias + GELU epilogue (`torch._addmm_activation`: the tanh form,
not the model's exact erf form; timed for comparison only) and a Triton TMA matrix product with
bias and exact GELU in its epilogue over a sweep of tile shapes. Prints microseconds per call and
the largest difference from a float32 reference.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import graph_time_us  # noqa: E402

COPIES = 8


@triton.jit
def _linear_gelu_kernel(a_desc, w_desc, out_desc, bias, num_rows, num_outputs, num_inputs,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One output tile: gelu(a @ w.T + bias), a [M, K], w [N, K] (an nn.Linear weight), fp32 accumulation."""
    tiles_m = tl.cdiv(num_rows, BLOCK_M)
    pid = tl.program_id(0)
    tile_m, tile_n = pid % tiles_m, pid // tiles_m  # neighbouring programs share a weight tile
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, num_inputs, BLOCK_K):
        a = a_desc.load([tile_m * BLOCK_M, k])
        w = w_desc.load([tile_n * BLOCK_N, k])
        acc = tl.dot(a, tl.trans(w), acc)
    outputs = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc += tl.load(bias + outputs, mask=outputs < num_outputs, other=0.0).to(tl.float32)[None, :]
    acc = 0.5 * acc * (1.0 + tl.erf(acc * 0.7071067811865476))
    out_desc.store([tile_m * BLOCK_M, tile_n * BLOCK_N], acc.to(out_desc.dtype))


def linear_gelu(a, weight, bias, config):
    block_m, block_n, block_k, warps, stages = config
    out = torch.empty(a.shape[0], weight.shape[0], dtype=a.dtype, device=a.device)
    a_desc = TensorDescriptor(a, list(a.shape), list(a.stride()), [block_m, block_k])
    w_desc = TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [block_n, block_k])
    o_desc = TensorDescriptor(out, list(out.shape), list(out.stride()), [block_m, block_n])
    grid = (triton.cdiv(a.shape[0], block_m) * triton.cdiv(weight.shape[0], block_n),)
    _linear_gelu_kernel[grid](a_desc, w_desc, o_desc, bias, a.shape[0], weight.shape[0], a.shape[1],
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1005)
    parser.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "mlp_gelu.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    tokens, width, hidden = args.tokens, 1024, 4096
    a = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    weights = [(torch.randn(hidden, width, device="cuda") / width**0.5).bfloat16() for _ in range(COPIES)]
    bias = (torch.randn(hidden, device="cuda") * 0.1).bfloat16()
    expected = F.gelu(F.linear(a.float(), weights[0].float(), bias.float()))
    flops = 2 * tokens * width * hidden

    def run(name, fn):
        error = (fn(weights[0]).float() - expected).abs().max().item()
        us = graph_time_us([functools.partial(fn, w) for w in weights])
        results[name] = {"us": us, "tflops": flops / us / 1e6, "max_err": error}
        print(f"{name:40s} {us:7.2f} us  {flops / us / 1e6:5.0f} TFLOP/s  max err {error:.2e}", flush=True)

    results: dict = {"device": torch.cuda.get_device_name(), "tokens": tokens}
    run("cuBLAS linear only (no GELU)", lambda w: F.linear(a, w, bias))
    run("cuBLAS linear + GELU (eager)", lambda w: F.gelu(F.linear(a, w, bias)))
    compiled = torch.compile(lambda x, w, b: F.gelu(F.linear(x, w, b)), dynamic=False)
    run("compiled linear + GELU (engine today)", lambda w: compiled(a, w, bias))
    run("cuBLASLt bias+GELU epilogue (tanh form)", lambda w: torch._addmm_activation(bias, a, w.t(), use_gelu=True))
    configs = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
               (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (256, 128, 64, 8, 3), (128, 64, 64, 4, 5)]
    for config in configs:
        try:
            run(f"triton linear+GELU {config}", lambda w, config=config: linear_gelu(a, w, bias, config))
        except Exception as error:  # a tile shape that does not fit is skipped
            print(f"triton {config}: {type(error).__name__}: {str(error)[:160]}", flush=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
