"""FP8 (E4M3) keys and values: the quantisation rule of the pages in 8 bits (PyTorch reference).

Each token's K (and V) of one head, 64 values, is stored as 64 e4m3 codes and one power-of-two
scale 2^e, e an int8 exponent: the scales of OCP's MX formats (E8M0, one per 32 values), here one
per head vector. A value x is stored as round(x / 2^e) with e the smallest exponent that keeps
the head vector's largest magnitude within e4m3's range (448):

    amax = max |x|  ->  2^e >= amax / 448  ->  codes = clamp(x / 2^e, ±448) in e4m3, nearest-even

Why a power of two rather than amax / 448 itself: multiplying by 2^e is exact, so a dequantised
value equals what the attention kernel computes with (it applies the scale to scores and
probabilities, not to the codes), and a bf16 copy of a dequantised value is exact too (e4m3's
4 significant bits fit in bf16's 8). The cost is at most one binade of e4m3's range at the top
(the largest code lies in (224, 448]); each value's own relative error stays 2^-4 at most
(3 mantissa bits), and only values below amax * 2^-14 lose more (e4m3's subnormals).

Scales are stored head-major, [..., H, tokens] int8 per layer and K/V, so that an attention
kernel reads a key block's scales of one head as one contiguous row.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# Exponents are kept where 2^e and 2^-e are both normal float32 numbers.
MIN_EXPONENT, MAX_EXPONENT = -126, 126
# The CUDA compute capability from which Triton has e4m3 (its fp8e4nv type: Ada, Hopper); our Triton
# kernels that write or read the codes (triton_store.py) compile from there on (Triton 3.x refuses
# the type on sm_80 and sm_86). Below it, PyTorch's casts write the store and dequantise it.
TRITON_E4M3_CAPABILITY = (8, 9)
_MANTISSA_BITS = 23  # float32
_MANTISSA_MASK = (1 << _MANTISSA_BITS) - 1
_MANTISSA_OF_1_75 = 0x600000  # 1.75 = 1 + 0.75: 448 = 1.75 * 2^8


def triton_has_e4m3(device: torch.device) -> bool:
    """Whether Triton kernels can read and write e4m3 codes on `device` (a CUDA GPU)."""
    return torch.cuda.get_device_capability(device) >= TRITON_E4M3_CAPABILITY


def scale_exponents(amax: torch.Tensor) -> torch.Tensor:
    """int8 exponents e of the smallest powers of two with 448 * 2^e >= amax (amax >= 0).

    Read off amax's float32 bits with no division: amax = m * 2^E (1 <= m < 2) and 448 = 1.75 * 2^8,
    so e = E - 8, plus one when m > 1.75. The Triton write kernel does the same integer arithmetic,
    so both give identical exponents. amax = 0 (or subnormal) gives the smallest exponent.
    """
    bits = amax.float().contiguous().view(torch.int32)
    exponent = (bits >> _MANTISSA_BITS) - 127 - 8 + ((bits & _MANTISSA_MASK) > _MANTISSA_OF_1_75).int()
    return exponent.clamp(MIN_EXPONENT, MAX_EXPONENT).to(torch.int8)


def exponent_scale(exponents: torch.Tensor) -> torch.Tensor:
    """2^e as float32, built from its bits (exact)."""
    return ((exponents.to(torch.int32) + 127) << _MANTISSA_BITS).view(torch.float32)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> codes [..., D] e4m3 and exponents [...] int8 (one per vector)."""
    x = x.float()
    exponents = scale_exponents(x.abs().amax(-1))
    inverse = exponent_scale(-exponents)  # 2^-e: exact, unlike a division on some devices
    codes = (x * inverse[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return codes, exponents


def dequantize(codes: torch.Tensor, exponents: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., D] e4m3, exponents [...] int8 -> values [..., D] in `dtype`, exact in bf16,
    float32 and float64 (2^e * code needs 4 significant bits and float32's exponent range).

    Computed in `dtype` itself, so that a dequantised copy of a layer's keys takes no more than its
    own bytes; fp16, whose range is narrower, goes through float32."""
    compute = torch.float32 if dtype == torch.float16 else dtype
    values = codes.to(compute)
    values *= exponent_scale(exponents).to(compute)[..., None]
    return values.to(dtype)
