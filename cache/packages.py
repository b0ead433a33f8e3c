"""Whether an optional package imports here: asked once per process, in this one place (the backend
table, the pages' fp8 write and the models' fused kernels all ask it)."""

from __future__ import annotations

import importlib
from functools import cache


@cache
def importable(package: str) -> bool:
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True
