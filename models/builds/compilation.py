"""torch.compile's output kept between runs: each compiled method is compiled once per call signature.

Compiling where first called, the first streaming frame of an input size waits while Dynamo traces
every block half and head part and Inductor builds their kernels: 10-19 s on a fresh machine, and
still 3-5 s with Inductor's on-disk caches warm, because Dynamo traces again in every process.
Here each call signature is compiled ahead of time instead (torch's
`aot_compile`: the traced bytecode, its guards and Inductor's kernels in one file), saved under an
artefact folder, and a later run loads the file rather than compiling: 0.5 s for a whole stream's
calls in a process that has their kernels, 4-5 s in a new one (Triton loading the kernels), which is
why the app keeps artefacts only where asked to (`artefacts_dir`).

The folder is per environment (`environment_key`: torch, triton, Python, the GPU, and this package's
model and cache sources, whose code the artefacts inline): a changed source or upgraded torch never
loads a stale artefact. A loaded artefact still checks its own guards before it serves a call; one
that fails them, cannot be read, or cannot be made (a graph break) gives way to an ordinary
torch.compile of that call.

Artefacts are pickles, like Inductor's own caches: the folder is created readable by its owner only.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import torch

from ..network import step_mode

logger = logging.getLogger("stream_recon.models.builds.compilation")

# The folder to keep artefacts in; unset or empty: compile where called, as torch.compile does. Not the
# default: in a new process loading 13 artefacts took 3.9-4.7 s (Triton loading their kernels), no less
# than compiling with Inductor's on-disk caches warm (3-5 s), and making them costs 5-10 s more than a
# cold compile. They pay where Inductor's caches do not last: a container
# whose /tmp starts empty, with this folder on a volume that persists.
ARTEFACTS_ENV = "STREAM_RECON_COMPILED"
_SOURCE_PACKAGES = ("models", "cache")  # the package folders whose code compiled artefacts inline

def artefacts_dir() -> Path | None:
    """$STREAM_RECON_COMPILED (a folder); None when it is unset or empty."""
    value = os.environ.get(ARTEFACTS_ENV, "").strip()
    return Path(value).expanduser() if value else None


class _CompiledWhereCalled:
    """torch.compile of `function`, except on a thread stepping as written (models/network/step_mode.py)."""

    __slots__ = ("compiled", "function")

    def __init__(self, function: Callable) -> None:
        self.function = function
        self.compiled = torch.compile(function, dynamic=False)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if step_mode.as_written():
            return self.function(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def compiled_where_called(function: Callable) -> Callable:
    """torch.compile(function, dynamic=False), compiled at its first call on a thread that is not
    stepping as written; on one that is, `function` as written."""
    return _CompiledWhereCalled(function)


@functools.cache
def source_digest() -> str:
    """sha256 of this package's model and cache sources (the code compiled artefacts inline)."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for package in _SOURCE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def environment_key(device: torch.device) -> str:
    """What an artefact is only valid under, as one folder name."""
    parts = [torch.__version__, platform.python_version(), source_digest()]
    with contextlib.suppress(ImportError):
        # Triton: absent on some machines
        import triton

        parts.append(triton.__version__)
    if device.type == "cuda":
        parts += [torch.cuda.get_device_name(device), str(torch.cuda.get_device_capability(device)),
                  str(torch.version.cuda)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]


def describe(value: Any) -> str:
    """A call argument as its shape of a signature: tensors by dtype, shape, strides, device and mode;
    modules by class and parameter shapes; dataclasses, lists and tuples by their parts; other values
    by type and value."""
    if isinstance(value, torch.Tensor):
        mode = "i" if value.is_inference() else ("g" if value.requires_grad else "n")
        return f"T{str(value.dtype)[6:]}{tuple(value.shape)}{value.stride()}{value.device}{mode}"
    if isinstance(value, torch.nn.Module):
        parameters = ",".join(f"{name}:{describe(p)}" for name, p in value.named_parameters())
        return f"{type(value).__qualname__}<{parameters}>"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{','.join(describe(item) for item in value)}]"
    if is_dataclass(value) and not isinstance(value, type):
        parts = ",".join(f"{field.name}={describe(getattr(value, field.name))}" for field in fields(value))
        return f"{type(value).__qualname__}({parts})"
    return f"{type(value).__qualname__}:{value!r}"


def call_signature(args: tuple) -> str:
    """sha256 (hex, 32 chars) of what a compiled call depends on besides its code: its arguments
    (`describe`; a method's module among them) and the autocast and grad modes."""
    device_type = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")
    autocast = torch.is_autocast_enabled(device_type)
    parts = [describe(list(args)),
             f"autocast={autocast}:{torch.get_autocast_dtype(device_type) if autocast else None}",
             f"grad={torch.is_grad_enabled()} inference={torch.is_inference_mode_enabled()}"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


class CompiledFunction:
    """A function compiled ahead of time for each call signature it meets, kept under `folder` (None:
    in memory only). For a module's method, the function is the class's (unbound) method and the
    module its first argument: one artefact then serves every instance of the class (their weights
    are inputs of the compiled code, not constants)."""

    def __init__(self, function: Callable, folder: Path | None):
        self.function = function
        self.folder = folder
        self._entries: list[Any] = []  # AOTCompiledFunction, guard checks done here (`_find`)
        self._usual: Callable | None = None  # torch.compile as where first called, once artefacts fail
        self._lock = threading.Lock()
        self.loaded = self.compiled = 0  # artefacts read from the folder / made by this process
        self.seconds = 0.0  # spent reading and compiling them

    def __call__(self, *args: Any) -> Any:
        if step_mode.as_written():
            return self.function(*args)
        if self._usual is not None:
            return self._usual(*args)
        entry = self._find(args)
        if entry is None:
            with self._lock:
                started = time.perf_counter()
                entry = self._find(args) or self._load_or_compile(args)
                self.seconds += time.perf_counter() - started
        return self._usual(*args) if entry is None else entry(*args)

    def _find(self, args: tuple) -> Any:
        return next((entry for entry in self._entries if entry.guard_check(*args)), None)

    def _load_or_compile(self, args: tuple) -> Any:
        """The artefact for this call: read from the folder, else compiled (and saved). None when no
        artefact can serve it: the function then compiles as torch.compile does, from now on."""
        path = None if self.folder is None else self.folder / f"{call_signature(args)}.pt"
        entry = self._read(path, args) if path is not None and path.exists() else None
        if entry is None:
            entry = self._compile(args)
            if entry is None:
                self._usual = compiled_where_called(self.function)
                return None
            self.compiled += 1
            if path is not None:
                self._write(entry, path)
        else:
            self.loaded += 1
        entry.disable_guard_check()  # (checked in `_find`, once per call)
        self._entries.append(entry)
        return entry

    def _read(self, path: Path, args: tuple) -> Any:
        try:
            with open(path, "rb") as file:
                entry = torch.compiler.load_compiled_function(file)
        except Exception as error:  # a torn write, an older format: compiled again and replaced
            logger.info("compiled artefact %s unreadable (%s: %s); compiling again", path, type(error).__name__, error)
            return None
        return entry if entry.guard_check(*args) else None

    def _compile(self, args: tuple) -> Any:
        try:
            with torch._dynamo.config.patch(enable_aot_compile=True):
                compiled = torch.compile(self.function, fullgraph=True, dynamic=False)
            return compiled.aot_compile((args, {}))
        except Exception as error:  # a graph break, or a torch without aot_compile: compile as usual
            logger.warning("%s: no ahead-of-time artefact (%s: %s); compiling where called instead",
                           self.function.__qualname__, type(error).__name__, str(error).splitlines()[0][:200])
            return None

    def _write(self, entry: Any, path: Path) -> None:
        temporary = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as file:
                temporary = Path(file.name)
            entry.save_compiled_function(str(temporary))
            os.replace(temporary, path)  # whole or not at all: another process may be reading the folder
        except Exception as error:  # a full or read-only disk costs the next run a compile, nothing more
            logger.warning("could not save the compiled artefact %s (%s: %s)", path, type(error).__name__, error)
            if temporary is not None:
                temporary.unlink(missing_ok=True)


class _InstalledMethod:
    """A CompiledFunction bound to one module (its first argument). Dynamo pickles a module,
    attributes and all, into an artefact's guards; this pickles as the plain method of the module's
    class, not as the compiled one (whose lock cannot be pickled)."""

    __slots__ = ("compiled", "module", "name")

    def __init__(self, compiled: CompiledFunction, module: torch.nn.Module, name: str):
        self.compiled, self.module, self.name = compiled, module, name

    def __call__(self, *args: Any) -> Any:
        return self.compiled(self.module, *args)

    def __reduce__(self):
        return getattr, (type(self.module), self.name)


class CompiledMethods:
    """The compiled code of one prepared model: one `CompiledFunction` per module class and method
    name, and per free function (`compile`), their artefacts under `root`/`environment_key`/<name>
    (`root` None: in memory only)."""

    def __init__(self, root: Path | None, device: torch.device):
        self.root = None if root is None else Path(root) / environment_key(device)
        self.methods: dict[Any, CompiledFunction] = {}
        self._lock = threading.Lock()  # engines on other threads compile functions too

    def install(self, module: torch.nn.Module, names: tuple[str, ...]) -> None:
        """Replace each named method of `module` (a freshly prepared one) by its compiled version."""
        for name in names:
            function = getattr(type(module), name)
            compiled = self._compiled(function, f"{type(module).__qualname__}.{name}")
            setattr(module, name, _InstalledMethod(compiled, module, name))

    def compile(self, function: Callable) -> CompiledFunction:
        """`function` (a module-level one) compiled per call signature, its artefacts kept with the
        model's: what torch.compile(function, dynamic=False) would be, without compiling again in
        every process. The same object for the same function."""
        return self._compiled(function, f"{function.__module__}.{function.__qualname__}")

    def _compiled(self, function: Callable, name: str) -> CompiledFunction:
        with self._lock:
            if function not in self.methods:
                self.methods[function] = CompiledFunction(function, None if self.root is None else self.root / name)
            return self.methods[function]

    def counts(self) -> dict[str, int]:
        """Artefacts loaded from disk and compiled by this process, over all methods."""
        methods = self.methods.values()
        return {"loaded": sum(m.loaded for m in methods), "compiled": sum(m.compiled for m in methods)}

    def seconds(self) -> float:
        """Time spent loading and compiling artefacts, over all methods (and threads)."""
        return sum(m.seconds for m in self.methods.values())


# -- which input sizes this machine has compiled ---------------------------------------------------
# Inductor keeps what it compiled on disk (its cache folder), and a run of an input size it holds
# compiles in 3-5 s; a size it does not hold takes 20-30 s of compiling before the first prediction.
# Which sizes it holds cannot be asked of Inductor, so each compiled
# warm-up leaves a record of its key in a folder inside Inductor's own: both go together when the
# folder is cleared (a reboot that empties /tmp, a new container), and a record never outlives the
# code it stands for.
RECORDS_FOLDER = "stream-recon-compiled"


def matmul_settings() -> dict[str, Any]:
    """The process-wide precision settings of matrix products and convolutions: Inductor's graph cache
    keys compiled graphs on them (the float32 precision as set, "none" when never set, which differs from
    "ieee" even where both compute the same), so a process that compiles for another takes the same."""
    names = ["matmul.allow_fp16_reduced_precision_reduction", "matmul.allow_bf16_reduced_precision_reduction"]
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        names += ["matmul.fp32_precision", "cudnn.fp32_precision"]
    else:  # a torch before the float32 precision settings
        names += ["matmul.allow_tf32", "cudnn.allow_tf32"]
    return {name: getattr(_backend(name), name.rsplit(".", 1)[1]) for name in names}


def use_matmul_settings(settings: dict[str, Any]) -> None:
    """Take another process's `matmul_settings` (each only where it differs: setting one marks it set)."""
    for name, value in settings.items():
        backend, attribute = _backend(name), name.rsplit(".", 1)[1]
        if getattr(backend, attribute) != value:
            setattr(backend, attribute, value)


def _backend(name: str) -> Any:
    return torch.backends.cuda.matmul if name.startswith("matmul.") else torch.backends.cudnn


def compiled_code_key(model_config: Any, stream_config: Any, image_size: tuple[int, int], dtype: torch.dtype,
                      device: torch.device) -> str:
    """What a streaming step's compiled code depends on besides its sources, as one name: the
    environment (`environment_key`), the model's architecture, the engine's settings, the frame size,
    the precision and this process's `matmul_settings`. Two runs with the same key compile the same calls."""
    parts = [environment_key(device), describe(model_config), describe(stream_config), f"{image_size}", f"{dtype}",
             describe(sorted(matmul_settings().items()))]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def records_folder() -> Path:
    """Where the records of compiled keys live: inside Inductor's cache folder ($TORCHINDUCTOR_CACHE_DIR,
    else its default under the temporary folder)."""
    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or _inductor_default_cache_dir()) / RECORDS_FOLDER


def _inductor_default_cache_dir() -> str:
    """Inductor's default cache folder by Inductor's own rule, read without importing torch._inductor,
    which imports Dynamo: 1.0-1.5 s of a fresh machine's run start that an uncompiled run has no other
    use for. The rule's file imports nothing of torch's but its environment
    flags, and torch keeps it so; loaded as its own module unless torch._inductor has loaded it."""
    module = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    if module is None:
        path = Path(torch.__file__).parent / "_inductor" / "runtime" / "cache_dir_utils.py"
        spec = importlib.util.spec_from_file_location("stream_recon_inductor_cache_dir_rule", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module.default_cache_dir()


def record(key: str, what: str = "compiled", note: str = "") -> None:
    """Leave a record of `key`: "compiled" (its compiled code is in Inductor's caches) or another word
    the caller reads back with `recorded`. A failure to write costs only the record."""
    folder = records_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        (folder / f"{key}.{what}").write_text(note + "\n")
    except OSError as error:
        logger.warning("could not record %s for compiled code %s (%s)", what, key, error)


def recorded(key: str, what: str) -> bool:
    """Whether `record(key, what)` was left since Inductor's caches were last cleared: `recorded(key,
    "compiled")`, whether a warm-up with this key compiled to its end on this machine."""
    return (records_folder() / f"{key}.{what}").is_file()
