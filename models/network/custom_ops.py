"""A kernel of ours made a torch operator for compiled code only, so that Inductor neither decomposes it
nor re-splits and fuses around it, while eager code calls the function itself.

The network's kernels (qk_norm_rope, fused_gelu, few_token_linear) are declared with it. It lives in the
network rather than with the compiled code it serves (builds/compilation.py), so that the network
imports nothing of the builds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def operator_for_compiled_code(name: str, fake: Callable) -> Callable[[Callable], Callable]:
    """Make a function a torch operator `name` (its output's shape given by `fake`) for compiled code
    only: under torch.compile the call is the operator, which Inductor neither decomposes nor re-splits
    and fuses around; eager code calls the function itself. An operator's first call imports Dynamo and
    its needs (~900 modules: 1.1-1.6 s on a fresh machine), which an
    uncompiled run has no other use for."""

    def wrap(function: Callable) -> Callable:
        operator = torch.library.custom_op(name, mutates_args=())(function)
        operator.register_fake(fake)

        @functools.wraps(function)
        def call(*args: Any) -> Any:
            return (operator if torch.compiler.is_compiling() else function)(*args)

        return call

    return wrap
