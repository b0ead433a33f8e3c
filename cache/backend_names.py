"""The attention backends' names, read from the folder of their files (cache/backends/) without importing
anything: the CLI checks --attention against them before it loads torch (a mistyped name is answered in a
second, not after torch's 2-5 s import). And the form of a backend's row (BackendSpec), which each file fills.

A backend's name is its file's, an underscore written as a hyphen (backends/flashinfer.py: flashinfer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (names for the row's types: this module loads without torch)
    import torch

    from .compiling import Compile
    from .kv_cache import AttentionBackend
    from .pages import CacheLayout
    from .store import PagedKV

AUTO = "auto"  # the fastest backend that runs here (backends.resolve)
FOLDER = Path(__file__).with_name("backends")
# Names of the two layouts' backends before the cache kept one (paged) layout, and the backend to use now:
# an old command line is answered with the name that replaced it.
RETIRED = {"dense": "sdpa", "dense-triton": "triton", "dense-cudnn": "triton", "dense-flashinfer": "flashinfer",
           "flashinfer-fa2": "flashinfer", "flashinfer-fa3": "flashinfer"}


@cache
def names() -> tuple[str, ...]:
    """Every name --attention accepts, `auto` first, then the folder's files in name order."""
    files = sorted(path.stem for path in FOLDER.glob("*.py") if not path.stem.startswith("_"))
    return (AUTO, *(stem.replace("_", "-") for stem in files))


def module_name(name: str) -> str:
    """The module of the backend named `name`, in cache/backends/."""
    return name.replace("-", "_")


def unknown_name_advice(name: str) -> str:
    """What to say of an --attention name that is no backend's: the one that replaced a retired name, or the list."""
    if name in RETIRED:
        return (f"--attention {name} was retired when the cache kept one (paged) layout: use {RETIRED[name]}, "
                f"or auto (the fastest that runs here)")
    return f"--attention must be one of {', '.join(names())}, got {name!r}"


# factory(storage, layout, compile, device, most_keys) -> backend; most_keys: the most keys a step reads, a
# whole window's pool's rows, also where the cache's pool holds fewer window pages (a spare's) or its storage
# holds more pages than its pool (a block lent beside it): a backend plans for the whole window.
BackendFactory = Callable[["PagedKV", "CacheLayout", "Compile", "torch.device", int], "AttentionBackend"]
# build_ahead(device, dtype, num_heads, head_dim, start_thread): the kernels a backend's first step would
# wait for, built now (start_thread(target, name) starts a supervised daemon thread for work beside it).
BuildAhead = Callable[["torch.device", "torch.dtype", int, int, Callable], None]


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    name: str
    summary: str  # one line for --help and `info`
    factory: BackendFactory
    needs: tuple[str, ...] = ()  # packages that must import
    cuda_half_only: bool = True  # runs on CUDA in bf16/fp16 only
    min_capability: int = 0  # CUDA compute capability (major) it needs
    # `auto` on CUDA in bf16/fp16 takes the available backend of the lowest rank (None: never), from this
    # capability on: ranks follow the measurements (docs/PERFORMANCE.md, *The engine*).
    auto_rank: int | None = None
    auto_min_capability: int = 0
    # It reads an fp8 (e4m3) store (through a per-layer dequantised copy of the visible keys and values in
    # the model's dtype, [N, H, D] each).
    reads_fp8: bool = False
    # The CUDA compute capability (major, minor) from which it reads an fp8 store: a Triton kernel reading
    # the codes needs Triton's e4m3 type.
    fp8_capability: tuple[int, int] = (0, 0)
    # It reads the visible keys through a per-layer copy of them (the SDPA reference's gather), which
    # memory plans count like fp8's dequantised copies.
    gathers: bool = False
    # What its first use on a machine costs, which a run says when it picks it ("": nothing).
    first_use: str = ""
    build_ahead: BuildAhead | None = None

    @property
    def module(self) -> str:
        return module_name(self.name)
