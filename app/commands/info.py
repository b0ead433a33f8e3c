"""Show what this installation can do: versions, CUDA and GPUs, attention backends, loop closure, the sky
network of --mask-sky, checkpoint locations.

Examples:

    stream-recon info
    stream-recon info --json > env.json        # attach to a bug report
"""

from __future__ import annotations

import json
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stream_recon.app.commands._options import output_console
from stream_recon.app.run.loops import pose_graph_library_problem
from stream_recon.models.attention_backends import auto_summary, backend_statuses, resolve_backend

_PACKAGES = ("stream-recon", "torch", "numpy", "opencv-python-headless", "pillow", "typer", "rich", "viser",
             "safetensors", "huggingface_hub", "gtsam", "flashinfer-python", "onnxruntime", "onnxruntime-gpu")


def info(
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")] = False,
) -> None:
    """Versions, CUDA/GPU, attention backends, whether loop closure and sky masking run, where checkpoints are
    looked up."""
    report = collect_info()
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    _print_report(report, output_console())


def collect_info() -> dict[str, Any]:
    # torch: for `info` itself, never for -h
    import torch

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in _PACKAGES},
        "cuda": _cuda_info(torch),
        "attention_backends": _attention_backends(torch),
        "loop_closure": _loop_closure_info(),
        "sky_masking": _sky_info(),
        "checkpoints": _checkpoint_info(),
    }


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _cuda_info(torch: Any) -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"available": False, "torch_cuda": torch.version.cuda, "devices": []}
    devices = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        devices.append({
            "index": index,
            "name": properties.name,
            "memory_gib": round(properties.total_memory / 2**30, 1),
            "compute_capability": f"{properties.major}.{properties.minor}",
        })
    return {"available": True, "torch_cuda": torch.version.cuda, "devices": devices}


def _attention_backends(torch: Any) -> dict[str, str]:
    """Every row of the backend table, available here or why not: on this machine's GPU in bf16
    when it has one (the default run), else on the CPU in float32."""
    device, dtype = ("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32)
    report = {"auto": f"{resolve_backend('auto', device, dtype)} here ({auto_summary()})"}
    for backend in backend_statuses(device, dtype):
        reason = backend.unavailable_reason
        report[backend.name] = (f"available ({backend.summary})" if reason is None
                                else f"not here: {reason}")
    return report


def _loop_closure_info() -> dict[str, Any]:
    """Whether runs here can close loops: gtsam, the pose graph's library, imports (app.run.loops says why not)."""

    problem = pose_graph_library_problem()
    return {"available": problem is None, "problem": None if problem is None else str(problem)}


def _sky_info() -> dict[str, Any]:
    """Whether --mask-sky runs here: onnxruntime imports, and skyseg.onnx is on this machine (app.outputs.sky)."""
    # OpenCV and onnxruntime: for `info` itself, never for -h
    from stream_recon.app.outputs.sky import (
        locate_skyseg,
        onnxruntime_problem,
        sky_extra_advice,
        skyseg_folder,
    )

    problem, found = onnxruntime_problem(), locate_skyseg()
    return {"available": problem is None and found is not None,
            "onnxruntime": None if problem is None else f"onnxruntime {problem}: {sky_extra_advice()}",
            "skyseg": None if found is None else str(found), "folder": str(skyseg_folder())}


def _checkpoint_info() -> dict[str, Any]:
    # huggingface_hub: for `info` itself, never for -h
    from stream_recon.models.hub_paths import (
        CHECKPOINT_DIR_ENV,
        HF_REPO_URL,
        KNOWN_CHECKPOINTS,
        checkpoint_dir,
        hub_cache_dir,
        hub_offline,
        locate_checkpoint,
    )

    found = {name: locate_checkpoint(name) for name in KNOWN_CHECKPOINTS}
    folder = checkpoint_dir()
    # a folder named by the environment that is not there is most likely a typo: said, not only listed
    missing = ", which does not exist" if os.environ.get(CHECKPOINT_DIR_ENV) and not Path(folder).is_dir() else ""
    return {
        "repository": HF_REPO_URL,
        "search_order": [f"{folder} (${CHECKPOINT_DIR_ENV}{missing})", f"{hub_cache_dir()} (Hugging Face cache)"],
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
            gpus.add_row(str(device["index"]), device["name"], f"{device['memory_gib']} GiB",
                         device["compute_capability"])
        console.print(gpus)
    else:
        built = f"torch built with CUDA {cuda['torch_cuda']}" if cuda["torch_cuda"] else "CPU-only torch build"
        console.print(f"CUDA: [yellow]not available[/yellow] ({built}); runs use the CPU")

    backends = Table("backend", "status", title="Attention backends (--attention)", title_justify="left")
    for name, status in report["attention_backends"].items():
        backends.add_row(name, escape(status))
    console.print(backends)

    loops = report["loop_closure"]
    if loops["available"]:
        console.print("Loop closure: [green]available[/green] (gtsam imports): `--loop-closure auto` closes loops "
                      "in streams that reach a third chunk")
    else:
        console.print(f"Loop closure: [yellow]not available[/yellow] ({escape(loops['problem'])}), runs go on without "
                      "it: pip install gtsam (one that does not import: pip install --force-reinstall gtsam)")

    sky = report["sky_masking"]
    runtime = "onnxruntime imports" if sky["onnxruntime"] is None else sky["onnxruntime"]
    network = (f"skyseg.onnx at {sky['skyseg']}" if sky["skyseg"] else "skyseg.onnx is not on this machine (`stream-"
               f"recon download skyseg`, or put it in {sky['folder']}; a run fetches it where the hub answers)")
    state = "[green]available[/green]" if sky["available"] else "[yellow]not ready[/yellow]"
    console.print(f"Sky masking (--mask-sky): {state}: {escape(runtime)}; {escape(network)}")

    checkpoints = report["checkpoints"]
    offline = ", offline mode" if checkpoints["offline"] else ""
    console.print(f"Checkpoints: a path is used as given; a name is looked up in (first match wins){offline}:")
    for place in checkpoints["search_order"]:
        console.print(f"  {escape(place)}")
    console.print(f"and otherwise downloaded from {checkpoints['repository']} on the first run.")
    for name, path in checkpoints["found"].items():
        where = escape(path) if path else f"[dim]not on this machine[/dim] (stream-recon download {name})"
        console.print(f"  {name}: {where}")
