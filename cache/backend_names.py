"""The names of the attention backends' table (backends.py), importable without torch: the CLI checks
--attention against them before it loads anything (a mistyped name is answered in a second, not after
torch's 2-5 s import).

The table's rows are the backends; this is their index. backends.py refuses to import when its rows and
ROW_NAMES do not pair up one to one, in order, so that adding a row means adding its name here.
"""

from __future__ import annotations

AUTO = "auto"  # the fastest backend that runs here (backends.resolve)
ROW_NAMES = ("sdpa", "flashinfer", "flashinfer-fa2", "flashinfer-fa3", "dense", "dense-triton", "dense-cudnn",
             "dense-flashinfer")


def names() -> tuple[str, ...]:
    """Every name --attention accepts, `auto` first."""
    return (AUTO, *ROW_NAMES)
