"""A package's public names imported on first use (PEP 562's module __getattr__), so that its light modules
load without torch: the package maps each name to the module of its own that defines it, and a name that
maps to itself is that module. cache/ and models/ both keep their names so."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_names(package: str, homes: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The package's `__getattr__` and `__dir__` for the names of `homes` (name -> module, relative to it)."""
    namespace = vars(sys.modules[package])

    def get(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f".{homes[name]}", package)
        value = module if homes[name] == name else getattr(module, name)
        namespace[name] = value  # the next use finds it without this hook
        return value

    def names() -> list[str]:
        return sorted({*namespace, *homes})

    return get, names
