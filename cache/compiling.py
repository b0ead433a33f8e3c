"""How a cache's small fixed-shape helpers are compiled: a caller's choice, made once."""

from __future__ import annotations

from collections.abc import Callable

import torch

# False: as written; True: torch.compile where first called; or a function that compiles a function
# (a model's kept artefacts, stream_recon.models.builds.compilation), which the cache need not know about.
Compile = bool | Callable[[Callable], Callable]


def compiled(function: Callable, compile: Compile) -> Callable:
    """`function` as `compile` asks (its shapes are fixed per stream: dynamic=False)."""
    if callable(compile):
        return compile(function)
    return torch.compile(function, dynamic=False) if compile else function
