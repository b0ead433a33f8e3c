"""Checkpoint IO: read, check, load and convert LingBot-Map checkpoints.

Two file formats are read:

- the official `.pt` / `.pth` files (a bare state dict, or `{"model": state_dict}`), always with
  `torch.load(weights_only=True)`: a file that needs arbitrary unpickling is refused, never executed;
- our `.safetensors` files, which carry the `ModelConfig` as JSON in their metadata, so a converted
  checkpoint needs no preset to rebuild its architecture.

Checkpoint keys stay the official ones (spec/checkpoint_keys.tsv); the model's parameter names are
those names, so no key conversion is needed. Where a checkpoint is (a path, or the names `lingbot-map-long`
and `lingbot-map` in our checkpoint folder and the Hugging Face cache) and its download are hub_paths.py's.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import stat
import warnings
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .checkpoint_names import CHECKPOINT_SIZE, DEFAULT_CHECKPOINT
from .daemon_pool import DaemonPool
from .errors import CheckpointError
from .hub_paths import (
    HF_REPO_URL,
    SAFETENSORS_SUFFIX,
    TORCH_SUFFIXES,
    checkpoint_digest,
    existing_checkpoint_file,
    resolve_checkpoint,
)
from .network.config import ModelConfig
from .supervision import Helper, HelperPolicy, WhenDown, WhenFull

if TYPE_CHECKING:
    from .network.gct import GCTStream

# The thread a conversion writes its checkpoint on (`_save_stoppably`): what it raises is the conversion's error.
CHECKPOINT_WRITER = HelperPolicy("the checkpoint's writer", WhenFull.PUSH_BACK, WhenDown.FAIL_RUN, stall_s=600.0)


# safetensors metadata keys (values must be strings)
CONFIG_METADATA_KEY = "stream_recon.model_config"
SOURCE_DIGEST_METADATA_KEY = "stream_recon.source_sha256"
SOURCE_NAME_METADATA_KEY = "stream_recon.source_name"

NAMES_SHOWN = 20  # longer name lists in error messages end with "... and N more"
# A checkpoint's problems of one kind (missing, wrong shape, ...) are named in the error's one line up to this
# many; more are counted there and listed by --verbose, where a few hundred names would not fit a line
NAMED_IN_SUMMARY = 3

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's default (zip) format; only this one can be memory-mapped
_PICKLE_PROTO = b"\x80"  # the legacy torch.save format starts with a protocol >= 2 pickle

# safetensors maps the whole file each time it is opened, and the pages read through a mapping stay in the
# process's resident set until it is closed; opening the file again for every piece of this size bounds
# what a load holds beside the tensors' own memory (opening costs about a millisecond).
READ_PIECE_BYTES = 16 << 20

# No trained weight comes near float16's largest value: the model also runs in float16 (GPUs before Ampere,
# the camera head's weights on every GPU), where such a value is inf. Bytes overwritten by random data or
# text read back as float32 are mostly far beyond it (and random bytes hold NaN and inf as well).
LARGEST_WEIGHT = float(torch.finfo(torch.float16).max)  # 65504

Shape = tuple[int, ...]


# -- reading ---------------------------------------------------------------------------------------

def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a `.pt` / `.pth` (bare or `{"model": ...}`) or `.safetensors` checkpoint, on the CPU.

    `.pt` files in the zip format are memory-mapped, so a 4.6 GB checkpoint costs no RAM until its
    tensors are touched. Raises CheckpointError for a missing, truncated or unsafe file, or one that
    does not hold a state dict of tensors.
    """
    path = existing_checkpoint_file(path)
    if path.suffix == SAFETENSORS_SUFFIX:
        contents = _read_safetensors(path)
    elif path.suffix in TORCH_SUFFIXES:
        contents = _read_torch_file(path)
    else:
        raise CheckpointError(
            f"{path}: unsupported checkpoint type {path.suffix or '(no extension)'!r}; "
            f"expected {', '.join(TORCH_SUFFIXES)} or {SAFETENSORS_SUFFIX}. Rename the file if it is one of those."
        )
    return _as_state_dict(contents, path)


def checkpoint_config(path: str | Path) -> ModelConfig | None:
    """The ModelConfig stored in a `.safetensors` file's metadata; None for `.pt` files and for
    safetensors files written by other tools (they carry no config)."""
    path = existing_checkpoint_file(path)
    if path.suffix != SAFETENSORS_SUFFIX:
        return None
    metadata = _safetensors_metadata(path)
    if CONFIG_METADATA_KEY not in metadata:
        return None
    try:
        return ModelConfig.from_dict(json.loads(metadata[CONFIG_METADATA_KEY]))
    except (ValueError, TypeError) as error:  # json.JSONDecodeError is a ValueError
        raise CheckpointError(
            f"{path}: the model config in its metadata ({CONFIG_METADATA_KEY}) is invalid: {error}. "
            "Pass the model config explicitly, or convert the .pt file again with this version."
        ) from None


def _read_torch_file(path: Path):
    with open(path, "rb") as file:
        magic = file.read(4)
    if not magic:
        raise CheckpointError(f"{path} is empty (0 bytes): the download or copy did not finish; fetch it again")
    zip_format = magic == _ZIP_MAGIC
    if not zip_format and not magic.startswith(_PICKLE_PROTO):
        raise CheckpointError(
            f"{path} is not a PyTorch checkpoint (it starts with neither a zip nor a pickle header); "
            "it may be another format with a .pt name, or a download error page saved to disk"
        )
    try:
        return torch.load(path, map_location="cpu", mmap=zip_format, weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights only load failed" in str(error).lower():
            raise CheckpointError(_unsafe_pickle_message(path)) from None
        raise CheckpointError(_corrupt_message(path, error)) from None
    except (RuntimeError, OSError, EOFError, KeyError, ValueError, IndexError) as error:
        raise CheckpointError(_corrupt_message(path, error)) from None


def _corrupt_message(path: Path, error: Exception) -> str:
    size = path.stat().st_size
    return (
        f"{path} is truncated or corrupt and cannot be read ({size:,} bytes; {type(error).__name__}: "
        f"{str(error).strip() or 'no detail'}). The official checkpoints are about {CHECKPOINT_SIZE} each. "
        f"Delete the file and fetch it again (stream-recon download NAME, or {HF_REPO_URL})."
    )


def _unsafe_pickle_message(path: Path) -> str:
    found = _unsafe_globals(path)
    what = f" ({', '.join(found)})" if found else ""
    cleaned = path.with_name(f"{path.stem}.tensors.pt")
    return (
        f"{path} contains arbitrary Python objects{what}, not only tensors. It will not be loaded: "
        "unpickling such objects can run any code, so stream-recon reads .pt files with weights_only=True "
        "only. If you trust where the file came from, convert it once to a plain state dict in a separate "
        "Python session:\n"
        f"    python -c \"import torch; c = torch.load('{path}', weights_only=False); sd = c.get('model', c); "
        f"torch.save({{k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}}, '{cleaned}')\"\n"
        f"then use {cleaned} (or `stream-recon convert {cleaned} {cleaned.with_suffix(SAFETENSORS_SUFFIX)}`)."
    )


def _unsafe_globals(path: Path) -> list[str]:
    """Names of the classes/functions a pickle would import, read without executing it (torch >= 2.5)."""
    find = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if find is None:
        return []
    try:
        return list(find(path))
    except Exception:  # only decorates the message; the refusal stands whatever this finds
        return []


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Views into the memory-mapped file: its data is read only where it is touched."""
    try:
        with safe_open(path, framework="pt", device="cpu") as file:
            return {name: file.get_tensor(name) for name in file.keys()}
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(_corrupt_message(path, error)) from None


def _load_safetensors(path: Path, names: Iterable[str], device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors `names` (best in the file's order: one sequential read) of a .safetensors file, each in
    memory of its own: on a CUDA device straight from the file, elsewhere on the CPU.

    The file is opened again for every READ_PIECE_BYTES of tensors, so the host holds at most that much
    of the mapped file beside the copies (one open for all: a 4.6 GB checkpoint twice over). The CPU
    copies are also 64-byte aligned, unlike the file's tensors, which safetensors packs back to back: CPU
    kernels take other vector paths on unaligned data, so the outputs would differ in the last bit from
    those of the same weights read from a .pt (torch.save aligns every tensor).
    """
    read_on = str(device) if device.type == "cuda" else "cpu"
    remaining = deque(names)
    tensors = {}
    try:
        while remaining:
            with safe_open(path, framework="pt", device=read_on) as file:
                piece_bytes = 0
                while remaining and piece_bytes < READ_PIECE_BYTES:
                    name = remaining.popleft()
                    tensor = file.get_tensor(name)
                    tensors[name] = tensor.clone() if read_on == "cpu" else tensor
                    piece_bytes += tensor.nbytes
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(_corrupt_message(path, error)) from None
    return tensors


def _safetensors_metadata(path: Path) -> dict[str, str]:
    try:
        with safe_open(path, framework="pt", device="cpu") as file:
            return file.metadata() or {}
    except (SafetensorError, OSError, ValueError) as error:
        raise CheckpointError(_corrupt_message(path, error)) from None


def _as_state_dict(contents, path: Path) -> dict[str, torch.Tensor]:
    """Unwrap `{"model": state_dict}` and check that what is left maps names to tensors."""
    if isinstance(contents, Mapping) and isinstance(contents.get("model"), Mapping):
        contents = contents["model"]
    if not isinstance(contents, Mapping):
        raise CheckpointError(
            f"{path} holds a {type(contents).__name__}, not a state dict (a mapping from parameter names to "
            "tensors, or {'model': state_dict}). Save the weights with torch.save(model.state_dict(), path)."
        )
    bad_names = [repr(name) for name in contents if not isinstance(name, str)]
    if bad_names:
        raise CheckpointError(
            f"{path}: a state dict's keys are parameter names (strings); found {len(bad_names)} other keys: "
            f"{_listing(bad_names)}"
        )
    not_tensors = [f"{name} ({type(value).__name__})" for name, value in contents.items()
                   if not isinstance(value, torch.Tensor)]
    if not_tensors:
        raise CheckpointError(
            f"{path} has {len(not_tensors)} entries that are not tensors: {_listing(not_tensors)}. A state dict "
            "maps parameter names to tensors only; save the model weights alone "
            "(torch.save(model.state_dict(), path) or {'model': model.state_dict()})."
        )
    if not contents:
        raise CheckpointError(f"{path} holds an empty state dict (no tensors); it is not a model checkpoint")
    return dict(contents)


def _listing(items: list[str], limit: int = NAMES_SHOWN) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... and {len(items) - limit} more" if len(items) > limit else "")


# -- checking --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StateDictReport:
    """How a checkpoint's tensors line up with a model's parameters, by name.

    missing: (name, model shape) of parameters the checkpoint lacks.
    unexpected: (name, checkpoint shape) of tensors the model has no parameter for.
    mismatched: (name, checkpoint shape, model shape) of tensors with the wrong shape.
    wrong_dtype: (name, checkpoint dtype) of integer or boolean tensors where the model has floats.
    loaded: names whose tensor fits (these are the ones a partial load uses).
    """

    loaded: tuple[str, ...]
    missing: tuple[tuple[str, Shape], ...] = ()
    unexpected: tuple[tuple[str, Shape], ...] = ()
    mismatched: tuple[tuple[str, Shape, Shape], ...] = ()
    wrong_dtype: tuple[tuple[str, str], ...] = ()

    @property
    def is_complete(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched or self.wrong_dtype)

    def summary(self) -> str:
        """One line: how many tensors match, and each kind of problem, its tensors named with their shapes
        where a kind has at most NAMED_IN_SUMMARY (describe() lists more)."""
        kinds = [
            ("missing", [f"{name} {_shape(shape)}" for name, shape in self.missing]),
            ("unexpected", [f"{name} {_shape(shape)}" for name, shape in self.unexpected]),
            ("with the wrong shape", [f"{name}: checkpoint {_shape(found)}, model {_shape(wanted)}"
                                      for name, found, wanted in self.mismatched]),
            ("with a non-float dtype", [f"{name}: {dtype}" for name, dtype in self.wrong_dtype]),
        ]
        problems = ", ".join(
            f"{len(named)} {what}" + (f" ({'; '.join(named)})" if len(named) <= NAMED_IN_SUMMARY else "")
            for what, named in kinds if named
        )
        return f"{len(self.loaded)} tensors match" + (f"; {problems}" if problems else "")

    def describe(self, limit: int = NAMES_SHOWN) -> str:
        """The summary, then each problem by name with its shapes, `limit` names per kind."""
        sections = [
            ("missing from the checkpoint (name, model shape)",
             [f"{name} {_shape(shape)}" for name, shape in self.missing]),
            ("unexpected in the checkpoint (name, checkpoint shape)",
             [f"{name} {_shape(shape)}" for name, shape in self.unexpected]),
            ("wrong shape (name: checkpoint shape -> model shape)",
             [f"{name}: {_shape(found)} -> {_shape(wanted)}" for name, found, wanted in self.mismatched]),
            ("not floating point (name: checkpoint dtype)",
             [f"{name}: {dtype}" for name, dtype in self.wrong_dtype]),
        ]
        lines = [self.summary()]
        for title, entries in sections:
            if entries:
                lines.append(f"{title}:")
                lines += [f"  {entry}" for entry in entries[:limit]]
                if len(entries) > limit:
                    lines.append(f"  ... and {len(entries) - limit} more")
        return "\n".join(lines)


def _shape(shape: Shape) -> str:
    return "[" + ", ".join(str(size) for size in shape) + "]"


def check_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor],
                     allow_partial: bool = False, source: str | Path | None = None) -> StateDictReport:
    """Compare a state dict with `model.state_dict()` by name, shape and dtype kind.

    Works on a model built under torch.device("meta") (only shapes are read). Raises one
    CheckpointError listing every problem unless `allow_partial`, in which case the report says what
    a partial load would skip. `source` names the checkpoint in the message.
    """
    expected = model.state_dict()
    loaded, missing, mismatched, wrong_dtype = [], [], [], []
    for name, wanted in expected.items():
        found = state_dict.get(name)
        if found is None:
            missing.append((name, tuple(wanted.shape)))
        elif found.shape != wanted.shape:
            mismatched.append((name, tuple(found.shape), tuple(wanted.shape)))
        elif wanted.is_floating_point() and not found.is_floating_point():
            wrong_dtype.append((name, str(found.dtype).removeprefix("torch.")))
        else:
            loaded.append(name)
    unexpected = [(name, tuple(tensor.shape)) for name, tensor in state_dict.items() if name not in expected]
    report = StateDictReport(tuple(loaded), tuple(missing), tuple(unexpected), tuple(mismatched), tuple(wrong_dtype))
    if not report.is_complete and not allow_partial:
        raise CheckpointError(_mismatch_message(report, model, source))
    return report


def _mismatch_message(report: StateDictReport, model: torch.nn.Module, source: str | Path | None) -> str:
    where = f"{source}: " if source is not None else ""
    config = getattr(model, "config", None)
    hint = ""
    if not report.loaded:
        hint = "No tensor matches at all: is this a LingBot-Map checkpoint? "
    elif report.mismatched and config is not None:
        hint = ("Shapes differ, so the checkpoint was made for another model configuration; a .pt file is "
                "loaded with the official configuration unless you pass config=. ")
    return (
        f"{where}the checkpoint does not match the model: {report.describe()}\n"
        f"{hint}Use the checkpoint made for this model, or, to run anyway with only the matching tensors "
        "loaded (the rest keep their random initialisation), pass allow_partial=True (CLI: --allow-partial)."
    )


def check_weight_values(tensors: Mapping[str, torch.Tensor], source: str | Path) -> None:
    """Raise CheckpointError naming every tensor (all on one device) that holds NaN, inf, or a value
    beyond ±LARGEST_WEIGHT.

    A file whose data bytes were damaged (on disk, or in a download) reads like any other, and the model
    then predicts NaN for every frame. One aminmax per tensor reads its data once, with no temporary
    the size of the tensor, and propagates NaN; one copy to the host brings every result back. The
    1.16 B float32 weights take about half a second on one CPU core.
    """
    checked = [(name, tensor) for name, tensor in tensors.items() if tensor.is_floating_point() and tensor.numel()]
    if not checked:
        return
    extremes = torch.stack([torch.stack(torch.aminmax(tensor)).float() for _, tensor in checked]).tolist()  # [T, 2]
    bad = [f"{name} ({_value_range(low, high)})" for (name, _), (low, high) in zip(checked, extremes, strict=True)
           if not -LARGEST_WEIGHT <= low <= high <= LARGEST_WEIGHT]  # False for NaN
    if bad:
        raise CheckpointError(
            f"{source}: {len(bad)} of {len(checked)} tensors hold NaN, infinite or impossibly large values "
            f"(beyond ±{LARGEST_WEIGHT:g}, the float16 range): {_listing(bad)}. The file is damaged (an "
            "interrupted or corrupted download or copy, or a disk error) and would make every prediction NaN. "
            f"Delete {Path(source).resolve()} and fetch it again ({HF_REPO_URL} for the official checkpoints)."
        )


def _value_range(low: float, high: float) -> str:
    return "NaN" if math.isnan(low) or math.isnan(high) else f"values from {low:.3g} to {high:.3g}"


# -- loading ---------------------------------------------------------------------------------------

def load_model(checkpoint: str | Path | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = None, config: ModelConfig | None = None,
               allow_partial: bool = False) -> GCTStream:
    """Build a GCTStream and load a checkpoint into it, ready for inference (eval, no grad).

    checkpoint: a file (.pt/.pth/.safetensors), a known name (`lingbot-map-long`, `lingbot-map`)
    found on this machine, or None for `lingbot-map-long`. config: the architecture; None takes it
    from a .safetensors file's metadata, else the official preset. dtype: None keeps float32 (the
    engine casts what it needs). allow_partial: load only the tensors that fit and warn, instead of
    raising on a mismatch.

    Raises CheckpointError for a file that cannot be read, does not match the model, or holds damaged
    weights (check_weight_values). A .pt's tensors stay memory-mapped on the CPU; a .safetensors file's
    are read a piece at a time into memory of their own, on the GPU straight from the file.
    """
    path = resolve_checkpoint(DEFAULT_CHECKPOINT if checkpoint is None else checkpoint)
    config = config or checkpoint_config(path) or ModelConfig()
    device = torch.device(device)
    # Meta construction allocates nothing and skips random init; the checkpoint's tensors then become
    # the parameters themselves (memory-mapped from a .pt, read to the device from a .safetensors).
    with torch.device("meta"):
        model = _built(config)
    if path.suffix == SAFETENSORS_SUFFIX:
        mapped = read_state_dict(path)  # views into the mapped file: its data is not read yet
        report = check_state_dict(model, mapped, allow_partial=allow_partial, source=path)
        in_file_order = sorted(report.loaded, key=lambda name: mapped[name].data_ptr())
        del mapped
        state_dict = _load_safetensors(path, in_file_order, device)
    else:
        state_dict = read_state_dict(path)
        report = check_state_dict(model, state_dict, allow_partial=allow_partial, source=path)
    if report.is_complete:
        model.load_state_dict(state_dict, strict=True, assign=True)
    else:
        model = _load_partial(config, state_dict, report)
        warnings.warn(f"{path}: partial checkpoint load: {report.describe()}", stacklevel=2)
    _check_materialized(model)
    model = model.to(device=device, dtype=dtype or torch.float32)
    check_weight_values(dict(model.named_parameters()), source=path)
    return model.eval().requires_grad_(False)


def _built(config: ModelConfig) -> GCTStream:
    """The network of `config`, imported here: with the Triton kernels its layers bring, about a second that
    finding a checkpoint (`info`, a run's first check) does not need."""
    from .network.gct import GCTStream  # the network and its kernels: only when a model is built

    return GCTStream(config)


def _load_partial(config: ModelConfig, state_dict: Mapping[str, torch.Tensor],
                  report: StateDictReport) -> GCTStream:
    """A model with the checkpoint's fitting tensors and its own seeded init for the rest, so a
    partial load gives the same model every time (the official demo loads with strict=False too)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _built(config)
    fitting = {name: state_dict[name] for name in report.loaded}
    model.load_state_dict(fitting, strict=False)
    return model


def _check_materialized(model: torch.nn.Module) -> None:
    """Meta + assign is complete only because the model has no buffers and keeps no tensor attributes
    made at construction; fail loudly if a later change breaks that, rather than at the first frame."""
    left_on_meta = [name for name, tensor in model.state_dict(keep_vars=True).items() if tensor.is_meta]
    left_on_meta += [name for name, buffer in model.named_buffers() if buffer.is_meta]
    for module_name, module in model.named_modules():
        left_on_meta += [f"{module_name}.{attribute}" for attribute, value in vars(module).items()
                         if isinstance(value, torch.Tensor) and value.is_meta]
    if left_on_meta:
        raise RuntimeError(
            "internal error: tensors left on the meta device after loading (a buffer or tensor attribute "
            f"the checkpoint does not carry): {_listing(sorted(set(left_on_meta)))}"
        )


# -- converting ------------------------------------------------------------------------------------

def convert_to_safetensors(src_pt: str | Path, dst: str | Path, config: ModelConfig | None = None) -> Path:
    """Write a checkpoint as .safetensors with its model config and the source's sha256 in the metadata.

    The tensors are checked strictly against the config's model first, so only a loadable file is
    written. The file appears under `dst` only when complete. Returns `dst`.
    """
    src, dst = existing_checkpoint_file(src_pt), Path(dst).expanduser()
    if dst.suffix != SAFETENSORS_SUFFIX:
        raise CheckpointError(f"the converted file must end in {SAFETENSORS_SUFFIX}, got {dst.name}")
    if dst.exists() and dst.resolve() == src.resolve():
        raise CheckpointError(f"{dst} is the source file itself; choose another destination")
    config = config or checkpoint_config(src) or ModelConfig()
    state_dict = read_state_dict(src)
    with torch.device("meta"):
        model = _built(config)
    check_state_dict(model, state_dict, source=src)
    metadata = {
        "format": "pt",
        CONFIG_METADATA_KEY: config.to_json(),
        SOURCE_DIGEST_METADATA_KEY: checkpoint_digest(src),
        SOURCE_NAME_METADATA_KEY: src.name,
    }
    tensors = {name: state_dict[name].contiguous() for name in model.state_dict()}
    try:
        folder = _converting_folder(dst.parent)
        partial = folder / dst.name
        mode = _mode_of_a_new_file(partial)
        _save_stoppably(tensors, partial, metadata)
        # safetensors writes through a private temporary file (0600) that replaces ours; give the result
        # the mode any new file gets, so a checkpoint in a shared folder is readable as the umask allows
        os.chmod(partial, mode)
        os.replace(partial, dst)
    except OSError as error:
        raise CheckpointError(f"cannot write {dst}: {error}. Check free disk space and permissions.") from None
    finally:
        _remove_converting_folder(dst.parent / f"{CONVERTING_PREFIX}{os.getpid()}")
    return dst


def _save_stoppably(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """save_file on a worker thread, waited for where a signal lands: safetensors writes in native code,
    where Python runs no signal handler, so a Ctrl-C or SIGTERM took effect only once the whole file was
    written (13 s for the official 4.6 GB checkpoint; a stop is promised within 10 s). A lock's wait is
    interrupted by a signal's handler. Stopped, the caller removes the file; the worker, a daemon thread,
    ends with the process, its job holding the tensors it reads until then."""
    writer = DaemonPool(1, "checkpoint-writer", Helper(CHECKPOINT_WRITER))
    try:
        writer.submit(save_file, tensors, path, metadata).result()  # unbounded-ok: a disk's write; a signal ends it
    finally:
        writer.shutdown()


# A conversion writes into a hidden folder of its own beside the destination, named by its process, and so
# does safetensors (its temporary file goes beside the file it is given): a conversion killed part-way
# (SIGKILL) leaves the folder, and the next conversion into that folder removes those of processes that no
# longer run, a checkpoint's size (4.6 GB) of them each.
CONVERTING_PREFIX = ".stream-recon-convert."


def _converting_folder(parent: Path) -> Path:
    for entry in parent.glob(f"{CONVERTING_PREFIX}*"):
        owner = entry.name.removeprefix(CONVERTING_PREFIX)
        if owner.isdigit() and not _process_runs(int(owner)):
            _remove_converting_folder(entry)
    folder = parent / f"{CONVERTING_PREFIX}{os.getpid()}"
    folder.mkdir(exist_ok=True)
    return folder


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it runs
        return True
    return True


def _remove_converting_folder(folder: Path) -> None:
    if not folder.is_dir() or folder.is_symlink():
        return
    try:
        for entry in folder.iterdir():
            entry.unlink(missing_ok=True)
        folder.rmdir()
    except OSError:  # left for the next conversion there: a failed clean-up must not hide why the write failed
        pass


def _mode_of_a_new_file(path: Path) -> int:
    """The permission bits a file created at `path` gets (0o666 less the umask, or a folder's default ACL),
    learned by creating it: the umask can only be read by setting it, which races with other threads."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        return stat.S_IMODE(os.fstat(descriptor).st_mode)
    finally:
        os.close(descriptor)

