"""Show what this installation can do: versions, CUDA and GPUs, attention backends, checkpoint locations.

Examples:

    stream-recon info
    stream-recon info --json > env.json        # attach to a bug report
"""

from __future__ import annotations

import json
import platform
from importlib import metadata
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

_PACKAGES = ("stream-recon", "torch", "numpy", "opencv-python-headless", "pillow", "typer", "rich", "viser",
             "safetensors", "huggingface_hub", "flashinfer-python")


def info(
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")] = False,
) -> None:
    """Versions, CUDA/GPU, attention backends and where checkpoints are looked up."""
    report = collect_info()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    _print_report(report, Console())


def collect_info() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in _PACKAGES},
        "cuda": _cuda_info(),
        "attention_backends": _attention_backends(),
        "checkpoints": _checkpoint_info(),
    }


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _cuda_info() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"available": False, "torch_cuda": torch.version.cuda, "devices": []}
    devices = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        devices.append({
            "index": index,
            "name": properties.name,
            "memory_gb": round(properties.total_memory / 2**30, 1),
            "compute_capability": f"{properties.major}.{properties.minor}",
        })
    return {"available": True, "torch_cuda": torch.version.cuda, "devices": devices}


def _dense_triton_status(torch) -> str:
    try:
        import triton  # noqa: F401 - only its presence matters here
    except ImportError as error:
        return f"not installed ({error.msg}); CUDA builds of torch bring triton along"
    if not torch.cuda.is_available():
        return "installed, but needs a CUDA GPU (none found)"
    return "available (contiguous cache, one Triton kernel over the whole key range; the default on Hopper GPUs)"


def _attention_backends() -> dict[str, str]:
    """Which backends `--attention` can use here, with the reason when one cannot."""
    import torch

    backends = {
        "dense": "available (contiguous cache, PyTorch SDPA reading keys in place; CPU and CUDA)",
        "dense-triton": _dense_triton_status(torch),
        "dense-cudnn": (
            "available (contiguous cache, cuDNN fused attention + flash; the default on Hopper GPUs without triton)"
            if torch.cuda.is_available() else "needs a CUDA GPU (none found)"
        ),
        "sdpa": "available (paged cache, PyTorch scaled_dot_product_attention; CPU and CUDA; the default on CPU)",
    }
    try:
        import flashinfer  # noqa: F401 - only its presence matters here
    except ImportError as error:
        backends["flashinfer"] = (
            f"not installed ({error.msg}); on a CUDA machine: scripts/setup-env cuda in a checkout, "
            "else pip install 'stream-recon[cuda]' where stream-recon is installed"
        )
    else:
        backends["flashinfer"] = (
            "available" if torch.cuda.is_available() else "installed, but needs a CUDA GPU (none found)"
        )
    return backends


def _checkpoint_info() -> dict[str, Any]:
    from stream_recon.models.checkpoint import (
        CHECKPOINT_DIR_ENV,
        HF_REPO_URL,
        KNOWN_CHECKPOINTS,
        checkpoint_dir,
        hub_cache_dir,
        hub_offline,
        locate_checkpoint,
    )

    found = {name: locate_checkpoint(name) for name in KNOWN_CHECKPOINTS}
    return {
        "repository": HF_REPO_URL,
        "search_order": [f"{checkpoint_dir()} (${CHECKPOINT_DIR_ENV})", f"{hub_cache_dir()} (Hugging Face cache)"],
        "offline": hub_offline(),
        "found": {name: str(path) if path else None for name, path in found.items()},
    }


def _print_report(report: dict[str, Any], console: Console) -> None:
    console.print(f"[bold]stream-recon[/bold] {report['packages']['stream-recon'] or '(not installed)'} "
                  f"on Python {report['python']}, {report['platform']}")
    packages = Table("package", "version", title="Packages", title_justify="left")
    for name, version in report["packages"].items():
        packages.add_row(name, escape(version) if version else "[dim]not installed[/dim]")
    console.print(packages)

    cuda = report["cuda"]
    if cuda["available"]:
        gpus = Table("index", "GPU", "memory", "compute", title=f"CUDA {cuda['torch_cuda']}", title_justify="left")
        for device in cuda["devices"]:
            gpus.add_row(str(device["index"]), device["name"], f"{device['memory_gb']} GB",
                         device["compute_capability"])
        console.print(gpus)
    else:
        built = f"torch built with CUDA {cuda['torch_cuda']}" if cuda["torch_cuda"] else "CPU-only torch build"
        console.print(f"CUDA: [yellow]not available[/yellow] ({built}); runs use the CPU")

    backends = Table("backend", "status", title="Attention backends (--attention)", title_justify="left")
    for name, status in report["attention_backends"].items():
        backends.add_row(name, escape(status))
    console.print(backends)

    checkpoints = report["checkpoints"]
    offline = ", offline mode" if checkpoints["offline"] else ""
    console.print(f"Checkpoints: a path is used as given; a name is looked up in (first match wins){offline}:")
    for place in checkpoints["search_order"]:
        console.print(f"  {escape(place)}")
    console.print(f"and otherwise downloaded from {checkpoints['repository']} on the first run.")
    for name, path in checkpoints["found"].items():
        where = escape(path) if path else f"[dim]not on this machine[/dim] (stream-recon download {name})"
        console.print(f"  {name}: {where}")
