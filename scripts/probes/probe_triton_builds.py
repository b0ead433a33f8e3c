"""Whether our Triton kernels build faster side by side: the range kernel compiled for eight
specializations of its own (head sizes 32 and 64, the key range as two ints or in memory, either
tile order), one after another or on threads, on an empty Triton cache.

    TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/probes/probe_triton_builds.py --threads 1
    TRITON_CACHE_DIR=$(mktemp -d) python3 scripts/probes/probe_triton_builds.py --threads 8

A build spends part of its time in Python (Triton's front end and MLIR passes, under the interpreter
lock) and part outside it (LLVM's code generation, ptxas in a child process); threads gain only from
the second part. Prints one JSON line: the wall time of all builds and each build's.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from stream_recon.cache.triton_attention import attend_range_scheduled, run_table

TOKENS, HEADS, KEYS = 1042, 16, 4096


def build(head_dim: int, in_memory: bool, tails_last: bool) -> float:
    """One call of the range kernel whose specialization no other job shares; seconds until it ran."""
    started = time.perf_counter()
    q = torch.randn(TOKENS, HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(KEYS, HEADS, head_dim, device="cuda", dtype=torch.bfloat16)
    runs = torch.tensor(run_table([(0, KEYS)], 1), dtype=torch.int32, device="cuda") if in_memory else (0, KEYS)
    attend_range_scheduled(q, keys, keys, runs, slots=264, tails_last=tails_last)
    torch.cuda.current_stream().synchronize()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.zeros(1, device="cuda")  # the CUDA context, before anything is timed
    jobs = [(head_dim, in_memory, tails_last) for head_dim in (32, 64) for in_memory in (False, True)
            for tails_last in (False, True)]
    started = time.perf_counter()
    with ThreadPoolExecutor(args.threads) as pool:
        each = list(pool.map(lambda job: build(*job), jobs))
    print(json.dumps({"threads": args.threads, "builds": len(jobs), "wall_s": round(time.perf_counter() - started, 2),
                      "each_s": [round(s, 2) for s in each]}))


if __name__ == "__main__":
    main()
