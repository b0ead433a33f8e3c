"""The attention backends as the app sees them: the names --attention takes, whether each runs here, and
the one a run will use. The app reads the backend table (stream_recon.cache.backends) only through
these, so that the cache stays behind the model (app -> models -> cache).

The names come from the table's torch-free index (cache/backend_names.py) and the rest from the table
itself, which loads torch when first asked: the CLI checks a run's --attention before anything is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from stream_recon.cache import backend_names as table_index

if TYPE_CHECKING:
    import torch


def _table() -> ModuleType:
    # the table loads torch and the cache's kernels: when a backend is resolved or listed, never for the names
    from stream_recon.cache import backends

    return backends


def auto_summary() -> str:
    """What `auto` chooses, in one line."""
    return _table().AUTO_SUMMARY


@dataclass(frozen=True)
class BackendStatus:
    """One row of the backend table on a device and precision."""

    name: str
    summary: str
    unavailable_reason: str | None  # why it cannot run there, in one sentence; None: it can


def backend_names() -> tuple[str, ...]:
    """Every name --attention accepts, `auto` first."""
    return table_index.names()


def unknown_backend_advice(name: str) -> str:
    """One sentence for an --attention name that is no backend's (a retired one is told its successor)."""
    return table_index.unknown_name_advice(name)


def resolve_backend(name: str, device: torch.device | str, dtype: torch.dtype, kv_cache: str = "auto") -> str:
    """The name of the backend that `name` stands for on `device` in `dtype`, over a K/V cache stored as
    `kv_cache` asks (auto: in `dtype`; fp8). Raises ValueError saying what to use instead when `name`, or
    `kv_cache`, cannot be used there."""
    backends = _table()
    return backends.resolve(name, device, dtype, backends.store_dtype(kv_cache, dtype)).name


def backend_statuses(device: torch.device | str, dtype: torch.dtype) -> tuple[BackendStatus, ...]:
    """Every backend of the table (`auto` aside), and whether it runs on `device` in `dtype`."""
    backends = _table()
    return tuple(
        BackendStatus(name=spec.name, summary=spec.summary,
                      unavailable_reason=backends.unavailable_reason(spec.name, device, dtype))
        for spec in backends.BACKENDS
    )


def _row_of(name: str):
    """The row of a built backend's name: the row's own, or its variant's (flashinfer-fa3: flashinfer)."""
    return next((spec for spec in _table().BACKENDS if name == spec.name or name.startswith(spec.name + "-")), None)


def backend_summary(name: str) -> str:
    """The one line the backend table says of the backend a built cache names (`name`); "" for none."""
    row = _row_of(name)
    return row.summary if row is not None else ""


def first_use_note(name: str) -> str:
    """What the first use of the backend a built cache names (`name`) costs on a machine, for the run to say when
    it picks it; "": nothing worth saying."""
    row = _row_of(name)
    return row.first_use if row is not None else ""


def auto_fallback_reason(device: torch.device | str, dtype: torch.dtype, kv_cache: str = "auto") -> str | None:
    """Where `auto` takes a backend after the first of its order on this device, why the first cannot run here
    (one sentence, for the run to say); None where it takes the first, or runs the CPU's reference."""
    backends = _table()
    return backends.auto_passed_over(device, dtype, backends.store_dtype(kv_cache, dtype))
