"""The transformer blocks' four linear layers at streaming sizes: cuBLAS's default choice against the
fastest GEMM PyTorch's TunableOp finds, per shape (GPU machine).

    python3 scripts/probe_gemm.py --tokens 1005,1042,1375 --json $OUT/gemm.json

A frame of 518xH is (H/14)*37 + 6 tokens; every block runs qkv (1024 -> 3072), proj (1024 -> 1024),
fc1 (1024 -> 4096) and fc2 (4096 -> 1024) on them, with a bias, in bf16, 48 blocks a frame. At
1,005 rows a 128-row tile count is 7.9, and proj's and fc2's 1,024 columns make 64 tiles of 128x128
for 132 SMs: half the GPU idles unless the library splits K. This probe times each shape with its
inputs rotated among several copies (as 48 blocks' distinct weights are), then lets TunableOp
benchmark the library's candidates for it, and times the winner, and times a Triton product with the
bias in its epilogue (TMA loads) at several tile shapes, whose smaller tiles give more programs than
cuBLAS's choice. Microseconds (do_bench medians,
L2 cleared before each run), TFLOP/s against the rate measured on a large product in the same call.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

LAYERS = {"qkv": (1024, 3072), "proj": (1024, 1024), "fc1": (1024, 4096), "fc2": (4096, 1024)}  # (in, out)
COPIES = 8
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of the Triton product
TILES = [(64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3),
         (128, 128, 64, 4, 4)]


@triton.jit
def _linear_kernel(x_desc, w_desc, bias, out, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """out [M, N] = x [M, K] @ w [N, K]^T + bias [N]; programs column-major, so that neighbours share a
    weight tile."""
    program = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    row, column = (program % num_m) * BLOCK_M, (program // num_m) * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        acc = tl.dot(x_desc.load([row, k]), tl.trans(w_desc.load([column, k])), acc)
    columns = column + tl.arange(0, BLOCK_N)
    rows = row + tl.arange(0, BLOCK_M)
    acc += tl.load(bias + columns, mask=columns < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out + rows[:, None] * N + columns[None, :], acc.to(out.dtype.element_ty),
             mask=(rows[:, None] < M) & (columns[None, :] < N))


def triton_linear(x, w, b, tile):
    block_m, block_n, block_k, warps, stages = tile
    (m, k), n = x.shape, w.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    x_desc = TensorDescriptor(x, [m, k], [k, 1], [block_m, block_k])
    w_desc = TensorDescriptor(w, [n, k], [k, 1], [block_n, block_k])
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _linear_kernel[grid](x_desc, w_desc, b, out, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         NUM_STAGES=stages, num_warps=warps, num_stages=stages)
    return out


def bench(fn) -> float:
    return 1000 * triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def inputs(tokens: int, features_in: int, features_out: int):
    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return [(make(tokens, features_in), make(features_out, features_in) / features_in**0.5, make(features_out))
            for _ in range(COPIES)]


def rotating(operands, product):
    """A call of product(x, w, b) on the next copy of the operands at each call."""
    state = {"i": 0}

    def call():
        x, w, b = operands[state["i"] % COPIES]
        state["i"] += 1
        return product(x, w, b)
    return call


def linear(x, w, b):
    return F.linear(x, w, b)


def mm(x, w, b):
    return F.linear(x, w)


def peak_tflops() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / bench(lambda: a @ b) / 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1005,1042,1375")
    parser.add_argument("--tuning-ms", type=int, default=100, help="TunableOp's time per shape")
    parser.add_argument("--json")
    args = parser.parse_args()
    peak = peak_tflops()
    print(f"{torch.cuda.get_device_name()}: bf16 8192^3 product {peak:.0f} TFLOP/s", flush=True)
    cases = [(int(t), name, *LAYERS[name]) for t in args.tokens.split(",") for name in LAYERS]
    rows = []
    for tokens, name, features_in, features_out in cases:
        operands = inputs(tokens, features_in, features_out)
        flop = 2 * tokens * features_in * features_out
        row = {"tokens": tokens, "layer": name, "gflop": flop / 1e9}
        for label, product in (("linear", linear), ("mm", mm)):
            row[label] = bench(rotating(operands, product))
        x, w, b = operands[0]
        reference = F.linear(x.float(), w.float(), b.float())
        row["triton"] = {}
        for tile in TILES:
            error = ((triton_linear(x, w, b, tile).float() - reference).norm() / reference.norm()).item()
            call = rotating(operands, lambda x, w, b, tile=tile: triton_linear(x, w, b, tile))
            row["triton"][str(tile)] = {"us": bench(call), "error": error}
        rows.append(row)
    # TunableOp: every call below benchmarks the library's candidates for its shape once, then uses the winner
    torch.cuda.tunable.enable(True)
    torch.cuda.tunable.tuning_enable(True)
    torch.cuda.tunable.set_max_tuning_duration(args.tuning_ms)
    torch.cuda.tunable.set_filename(os.path.join(os.environ.get("OUT", "/tmp"), "tunableop.csv"))
    for row in rows:
        operands = inputs(row["tokens"], *LAYERS[row["layer"]])
        for label, product in (("linear", linear), ("mm", mm)):
            call = rotating(operands, product)
            call()
            torch.cuda.synchronize()
            row[f"{label}_tuned"] = bench(call)
    torch.cuda.tunable.tuning_enable(False)
    results = torch.cuda.tunable.get_results()
    print(f"{'tokens':>6} {'layer':>5} {'GFLOP':>6} | {'linear':>7} {'tuned':>7} | {'mm':>7} {'tuned':>7} | "
          f"TFLOP/s linear, best")
    total = {"linear": 0.0, "best": 0.0, "triton": 0.0}
    for row in rows:
        best = min(row["linear"], row["linear_tuned"])
        fastest = min(row["triton"].items(), key=lambda item: item[1]["us"])
        total["linear"] += row["linear"]
        total["best"] += best
        total["triton"] += min(best, fastest[1]["us"])
        print(f"{row['tokens']:>6} {row['layer']:>5} {row['gflop']:6.2f} | {row['linear']:7.1f} {row['linear_tuned']:7.1f} | "
              f"{row['mm']:7.1f} {row['mm_tuned']:7.1f} | {row['gflop'] * 1e3 / row['linear']:5.0f}, "
              f"{row['gflop'] * 1e3 / best:5.0f}  (ideal at {peak:.0f}: {row['gflop'] * 1e6 / peak / 1e3:.1f} us) | "
              f"Triton {fastest[1]['us']:.1f} us {fastest[0]} (error {fastest[1]['error']:.1e})")
        print("        Triton tiles: " + ", ".join(f"{t} {v['us']:.1f}" for t, v in row["triton"].items()))
    print(f"sum over the rows: linear {total['linear']:.1f} us, tuned linear {total['best']:.1f} us, "
          f"the faster of that and Triton's best {total['triton']:.1f} us")
    print(f"TunableOp's results ({len(results)}):")
    for result in results:
        print("  ", result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "peak_tflops": peak,
                       "rows": rows, "tunableop": [list(map(str, r)) for r in results]}, f, indent=1)


if __name__ == "__main__":
    main()
