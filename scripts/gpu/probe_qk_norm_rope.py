"""QK-norm + RoPE at the streaming shape (1,005 tokens, 16 heads x 64, bf16): the unfused path as the
engine compiled it (LayerNorm, rope, cast; two Inductor kernels, ~16 us) against the fused Triton
kernel (models/qk_norm_rope.py): its operator compiled as the blocks run it, and the bare launch
over a few block shapes, with the partner channels reloaded or swapped in registers, for both
rope kinds.

Each candidate runs inside a CUDA graph cycling through 8 qkv copies (more than L2 holds); prints
microseconds per call (q and k together) and the largest difference from the unfused path and
from a float32 reference. Run with stream_recon importable (scripts/gpu/env.sh).
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn

from stream_recon.models import qk_norm_rope
from stream_recon.models.rope import Rope2D, Rope3D, patch_positions_2d, positions_3d

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import graph_time_us  # noqa: E402

TOKENS, HEADS, HEAD_DIM, COPIES = 1005, 16, 64, 8
ROWS, COLS, SPECIALS = 37, 27, 6  # 518 x 378 frames: 6 + 37 * 27 = 1005 tokens


def unfused(qkv, q_norm, k_norm, rope):
    """What Attention.heads did: norms and rope under autocast (float32), cast to v's dtype."""
    q, k, v = qkv.reshape(*qkv.shape[:2], 3, HEADS, HEAD_DIM).unbind(2)
    q, k = rope(q_norm(q)), rope(k_norm(k))
    return q.to(v.dtype), k.to(v.dtype)


def main() -> None:
    torch.manual_seed(0)
    device, dtype = "cuda", torch.bfloat16
    norms = [nn.LayerNorm(HEAD_DIM, eps=1e-6) for _ in range(2)]
    for norm in norms:
        norm.weight.data.normal_(1, 0.3)
        norm.bias.data.normal_(0, 0.3)
    exact_norms = [n.to(device) for n in norms]
    q_norm, k_norm = (copy.deepcopy(n).to(dtype) for n in exact_norms)  # the engine's bf16 weights
    copies = [torch.randn(1, TOKENS, 3 * HEADS * HEAD_DIM, device=device).mul(2).add(0.5).to(dtype)
              for _ in range(COPIES)]
    ropes = {"rope2d": Rope2D.build(patch_positions_2d(ROWS, COLS, SPECIALS, device), HEAD_DIM, 100.0),
             "rope3d": Rope3D.build(positions_3d(torch.tensor([5], device=device), ROWS, COLS, SPECIALS),
                                    (20, 22, 22), 10000.0)}
    compiled = torch.compile(unfused, dynamic=False)
    fused = torch.compile(lambda x, qn, kn, rope: qk_norm_rope.qk_norm_rope(x, HEADS, qn, kn, rope), dynamic=False)
    results = {"device": torch.cuda.get_device_name()}
    with torch.inference_mode(), torch.autocast("cuda", dtype=dtype, cache_enabled=False):
        for kind, rope in ropes.items():
            params = (q_norm.weight, q_norm.bias, k_norm.weight, k_norm.bias, 1e-6, 1e-6,
                      rope.cos_full, rope.sin_signed, rope.pair_offset)
            baseline = compiled(copies[0], q_norm, k_norm, rope)
            exact = unfused(copies[0].float(), *exact_norms, rope)

            def run(name, fn, kind=kind, baseline=baseline, exact=exact):
                outputs = fn(copies[0])
                vs_old = max((a.float() - b.float()).abs().max().item() for a, b in zip(outputs, baseline, strict=True))
                vs_f32 = max((a.float() - b).abs().max().item() for a, b in zip(outputs, exact, strict=True))
                us = graph_time_us([lambda x=x: fn(x) for x in copies])
                results[f"{kind} {name}"] = {"us": us, "max_diff_vs_unfused": vs_old, "max_err_vs_fp32": vs_f32}
                print(f"{kind} {name:34s} {us:7.2f} us  vs unfused {vs_old:.2e}  vs fp32 {vs_f32:.2e}", flush=True)

            run("unfused, compiled", lambda x, rope=rope: compiled(x, q_norm, k_norm, rope))
            run("fused op, compiled", lambda x, rope=rope: fused(x, q_norm, k_norm, rope))
            for block_rows, warps, swap in itertools.product((16, 32, 64, 128), (2, 4, 8), (False, True)):
                run(f"fused rows={block_rows} warps={warps} swap={swap:d}", lambda x, b=block_rows, w=warps, s=swap,
                    p=params: qk_norm_rope.launch(x, HEADS, *p, block_rows=b, num_warps=w, swap=s))
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "qk_norm_rope.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
