"""The fused QK-norm + RoPE: the Triton kernel on the CPU through Triton's interpreter (the source the
GPU compiles) against LayerNorm then Rope2D / Rope3D, the ropes' expanded tables against the ropes,
and the operator's CPU path against the unfused Attention.heads."""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn
from triton_interpreter import interpret

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")

from stream_recon.models.network import qk_norm_rope  # noqa: E402
from stream_recon.models.network.layers import Attention  # noqa: E402
from stream_recon.models.network.rope import (  # noqa: E402
    Rope2D,
    Rope3D,
    patch_positions_2d,
    positions_3d,
    rotate_expanded,
)

# (rope kind, sequences B, frames in the sequence, dtype). A frame is 6 special tokens + 3 x 5
# patches = 21 tokens; with 4 heads and 16-row blocks no case fills its last block.
CASES = [("2d", 3, 1, "float32"), ("2d", 1, 1, "float32"), ("3d", 1, 3, "float32"), ("3d", 2, 2, "float32"),
         ("2d", 3, 1, "bfloat16"), ("2d", 1, 1, "bfloat16"), ("3d", 1, 3, "bfloat16"), ("3d", 2, 2, "bfloat16"),
         ("3d", 1, 2, "float16")]
HEADS, HEAD_DIM, ROWS, COLS, SPECIALS = 4, 64, 3, 5, 6


def make_rope(kind: str, frames: int, head_dim: int = HEAD_DIM, device=None) -> Rope2D | Rope3D:
    if kind == "2d":
        return Rope2D.build(patch_positions_2d(ROWS, COLS, SPECIALS, device), head_dim, 100.0)
    split = {64: (20, 22, 22), 32: (8, 12, 12)}[head_dim]  # channels for time, rows, cols
    time_index = torch.tensor([0, 5, 11, 900][:frames], device=device)
    return Rope3D.build(positions_3d(time_index, ROWS, COLS, SPECIALS), split, 10000.0)


SCRIPT = textwrap.dedent("""
    import sys, torch
    import torch.nn.functional as F
    from stream_recon.models.network.qk_norm_rope import launch
    from test_models_qk_norm_rope import HEADS, HEAD_DIM, make_rope

    torch.manual_seed(0)
    width = 3 * HEADS * HEAD_DIM
    for kind, batch, frames, dtype, swap in eval(sys.argv[1]):
        dtype = getattr(torch, dtype)
        rope = make_rope(kind, frames)
        tokens = rope.cos_full.shape[0]
        # rows 8 elements longer than the projection: the kernel must follow the token stride
        qkv = (torch.randn(batch, tokens, width + 8) * 2 + 0.5)[..., :width].to(dtype)
        params = [(torch.randn(HEAD_DIM) * 0.3 + shift).to(dtype) for shift in (1, 0, 1, 0)]  # q: w, b; k: w, b
        eps = (1e-6, 0.05)  # far apart: swapping them shows
        q, k = launch(qkv, HEADS, *params, *eps, rope.cos_full, rope.sin_signed, rope.pair_offset, block_rows=16,
                      swap=swap)
        parts = qkv.float().reshape(batch, tokens, 3, HEADS, HEAD_DIM).unbind(2)
        worst = []
        for out, x, weight, bias, e in ((q, parts[0], *params[:2], eps[0]), (k, parts[1], *params[2:], eps[1])):
            expected = rope(F.layer_norm(x, (HEAD_DIM,), weight.float(), bias.float(), e))
            assert out.shape == expected.shape and out.dtype == dtype and out.is_contiguous()
            error = (out.float() - expected).abs()
            ulp = expected.abs() * torch.finfo(dtype).eps + 1e-5  # float32's own error aside
            worst.append((error.max().item(), (error / ulp).max().item()))
        print(*(f"{a:.3e} {b:.3e}" for a, b in worst))
""")


@pytest.mark.slow
def test_kernel_matches_layer_norm_then_rope():
    cases = [(*case, swap) for case in CASES for swap in (False, True)]  # partners reloaded or swapped
    lines = interpret(SCRIPT, cases).strip().splitlines()  # (the script imports this file)
    assert len(lines) == len(cases)
    for case, line in zip(cases, lines, strict=True):
        q_error, q_ulps, k_error, k_ulps = (float(x) for x in line.split())
        for part, error, ulps in (("q", q_error, q_ulps), ("k", k_error, k_ulps)):
            if case[3] == "float32":
                assert error <= 1e-5, f"{case} {part}: max error {error:.2e}"
            else:  # one rounding of the float32 result: half a unit in the last place when rounded to
                # nearest, a whole one for bfloat16, which the interpreter truncates (the GPU rounds)
                limit = 1.0 if case[3] == "bfloat16" else 0.5
                assert ulps <= limit, f"{case} {part}: {ulps:.2f} units in the last place"


@pytest.mark.parametrize("kind,head_dim", [("2d", 64), ("3d", 64), ("2d", 32), ("3d", 32)])
def test_expanded_tables_reproduce_the_ropes_exactly(kind, head_dim):
    torch.manual_seed(0)
    rope = make_rope(kind, 3, head_dim)
    tokens = rope.cos_full.shape[0]
    assert rope.cos_full.shape == rope.sin_signed.shape == (tokens, head_dim)
    for batch in (1, 2):
        x = torch.randn(batch, tokens, 3, head_dim) * 3
        assert torch.equal(rotate_expanded(x, rope.cos_full, rope.sin_signed, rope.pair_offset), rope(x))


def _attention(dtype: torch.dtype = torch.float32, device=None) -> Attention:
    attention = Attention(HEADS * HEAD_DIM, HEADS, qk_norm=True, norm_eps=1e-6)
    for norm in (attention.q_norm, attention.k_norm):
        norm.weight.data.normal_(1, 0.3)
        norm.bias.data.normal_(0, 0.3)
    return attention.to(device=device, dtype=dtype).eval()


@pytest.mark.parametrize("kind,batch,frames", [("2d", 3, 1), ("3d", 1, 3)])
def test_operator_on_the_cpu_equals_the_unfused_attention_heads(kind, batch, frames):
    torch.manual_seed(0)
    attention, rope = _attention(), make_rope(kind, frames)
    x = torch.randn(batch, rope.cos_full.shape[0], HEADS * HEAD_DIM)
    with torch.no_grad():
        assert not qk_norm_rope.applies(attention.qkv(x), attention.q_norm, attention.k_norm, rope)  # CPU
        q, k, v = attention.heads(x, rope)
        fused_q, fused_k = qk_norm_rope.qk_norm_rope(attention.qkv(x), HEADS, attention.q_norm, attention.k_norm, rope)
    assert torch.equal(fused_q, q.transpose(1, 2)) and torch.equal(fused_k, k.transpose(1, 2))


def test_operator_schema_and_fake_implementation():
    attention, rope = _attention(torch.bfloat16), make_rope("2d", 1)
    qkv = torch.randn(2, rope.cos_full.shape[0], 3 * HEADS * HEAD_DIM, dtype=torch.bfloat16)
    args = (qkv, HEADS, attention.q_norm.weight.detach(), attention.q_norm.bias.detach(),
            attention.k_norm.weight.detach(), attention.k_norm.bias.detach(), 1e-6, 1e-6, rope.cos_full,
            rope.sin_signed, rope.pair_offset)
    torch.library.opcheck(torch.ops.stream_recon.qk_norm_rope.default, args,
                          test_utils=("test_schema", "test_faketensor"))


def test_other_attentions_keep_the_unfused_path():
    rope = make_rope("2d", 1)
    qkv = torch.zeros(1, rope.cos_full.shape[0], 3 * HEADS * HEAD_DIM)
    plain, normed = Attention(HEADS * HEAD_DIM, HEADS), _attention()
    with torch.no_grad():
        assert not qk_norm_rope.applies(qkv, plain.q_norm, plain.k_norm, rope)  # Identity norms
        assert not qk_norm_rope.applies(qkv, normed.q_norm, normed.k_norm, None)
        assert not qk_norm_rope.applies(qkv, normed.q_norm, normed.k_norm, rope)  # CPU


def test_launcher_refuses_mismatched_tables():
    rope = make_rope("2d", 1)
    qkv, norm = torch.zeros(1, rope.cos_full.shape[0] + 1, 3 * HEADS * HEAD_DIM), nn.LayerNorm(HEAD_DIM)
    with pytest.raises(ValueError, match="tables"):
        qk_norm_rope.launch(qkv, HEADS, norm.weight, norm.bias, norm.weight, norm.bias, 1e-5, 1e-5,
                            rope.cos_full, rope.sin_signed, rope.pair_offset)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kind,batch,frames", [("2d", 3, 1), ("3d", 1, 3)])
def test_attention_heads_on_cuda_take_the_fused_path_within_one_rounding(kind, batch, frames):
    torch.manual_seed(0)
    attention, rope = _attention(torch.bfloat16, "cuda"), make_rope(kind, frames, device="cuda")
    x = torch.randn(batch, rope.cos_full.shape[0], HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
        assert qk_norm_rope.applies(attention.qkv(x), attention.q_norm, attention.k_norm, rope)
        fused = attention.heads(x, rope)
        unfused = attention.heads(x, rope.__call__)  # not a Rope2D / Rope3D: the unfused path
    assert all(t.transpose(1, 2).is_contiguous() for t in fused[:2])
    for got, expected in zip(fused, unfused, strict=True):
        assert got.dtype == expected.dtype == torch.bfloat16
        error = (got.float() - expected.float()).abs()
        assert (error <= expected.float().abs() * 2.0 ** -7 + 1e-5).all()  # one bf16 unit at most
