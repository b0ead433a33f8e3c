"""Where checkpoints live on this machine and how the Hugging Face hub is reached, read from the environment
when asked, and where a checkpoint is: a path, or a known name found here (`locate_checkpoint`,
`resolve_checkpoint`) or fetched from the hub (`download_checkpoint`), and a checkpoint file's identity (its
sha256, `checkpoint_digest`: what a saved map is checked against). Free of torch, so that a command that
only reads a run directory (`export`, its sky masks) starts without torch's import (2.5 s of CPU on a 2-core
machine), and `info` lists the checkpoints without it. checkpoint.py reads, checks, loads and converts."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from huggingface_hub import constants as hf_constants
from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

from .checkpoint_names import CHECKPOINT_SIZE, DEFAULT_CHECKPOINT, KNOWN_CHECKPOINTS
from .errors import CheckpointError, CheckpointUnavailable

CHECKPOINT_DIR_ENV = "STREAM_RECON_CHECKPOINTS"
DEFAULT_CHECKPOINT_DIR = "~/.cache/stream-recon/checkpoints"


def checkpoint_dir() -> Path:
    """Our own checkpoint folder: $STREAM_RECON_CHECKPOINTS, else ~/.cache/stream-recon/checkpoints."""
    return Path(os.environ.get(CHECKPOINT_DIR_ENV) or DEFAULT_CHECKPOINT_DIR).expanduser()


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache. huggingface_hub reads its environment once, at import; reading it
    here on every call lets a caller (or a test) that sets HF_HUB_CACHE / HF_HOME later be obeyed."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.path.expandvars(os.environ[variable])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    return Path(hf_constants.HF_HUB_CACHE)


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now (see hub_cache_dir for why not huggingface_hub's import-time value)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        return bool(hf_constants.HF_HUB_OFFLINE)
    return value.strip().upper() in {"1", "ON", "YES", "TRUE"}


def hub_endpoint() -> str:
    """HF_ENDPOINT, read now (see hub_cache_dir), else huggingface_hub's default (https://huggingface.co)."""
    return (os.environ.get("HF_ENDPOINT") or hf_constants.ENDPOINT).rstrip("/")


def hub_unreachable(url: str) -> Exception | None:
    """Ask the hub for one file's metadata, once and without retries: the error when the hub cannot be reached,
    None when it answered, whatever it said (not found, gated, busy: the download that follows reports that).

    When a file is not cached, hf_hub_download retries a refused or timed-out connection with back-off for
    about 25 s before it gives up, logging each retry; one request tells an unreachable hub apart at once.
    """
    try:
        get_hf_file_metadata(url, timeout=hf_constants.HF_HUB_ETAG_TIMEOUT)
    except HfHubHTTPError:
        return None
    except Exception as error:  # noqa: BLE001 - transport errors are requests' or httpx's, by huggingface_hub version
        return error
    return None


# -- the known checkpoints: where they are, and their download ----------------------------------------------
HF_REPO_ID = "robbyant/lingbot-map"
HF_REPO_URL = f"https://huggingface.co/{HF_REPO_ID}"
TORCH_SUFFIXES = (".pt", ".pth")
SAFETENSORS_SUFFIX = ".safetensors"


def existing_checkpoint_file(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder; pass the checkpoint file inside it (.pt or .safetensors)")
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint file not found: {path}. Check the path, or pass a known name "
            f"({', '.join(KNOWN_CHECKPOINTS)}) to use a downloaded official checkpoint."
        )
    return path


def locate_checkpoint(name: str) -> Path | None:
    """Where the known checkpoint `name` is on this machine, or None. Looks in checkpoint_dir() for
    `<name>.safetensors` (a converted copy) then the official file name, then in the hub cache."""
    filename = _known_filename(name)
    own = checkpoint_dir()
    for candidate in (own / f"{name}{SAFETENSORS_SUFFIX}", own / filename):
        if candidate.is_file():
            return candidate
    cached = try_to_load_from_cache(HF_REPO_ID, filename, cache_dir=hub_cache_dir())
    return Path(cached) if isinstance(cached, str) else None


def resolve_checkpoint(name_or_path: str | Path) -> Path:
    """The checkpoint file for a path or a known name. Downloads nothing: a known name that is not on
    this machine raises CheckpointError saying how to fetch it and where to put it."""
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    name = str(name_or_path)
    if name in KNOWN_CHECKPOINTS:
        found = locate_checkpoint(name)
        if found is None:
            raise CheckpointError(_not_on_this_machine_message(name))
        return found
    if path.is_dir() or path.suffix in (*TORCH_SUFFIXES, SAFETENSORS_SUFFIX) or os.sep in name:
        return existing_checkpoint_file(path)  # raises, naming the path
    raise CheckpointError(
        f"unknown checkpoint {name!r}: it is neither a file nor a known name. "
        f"Known names: {', '.join(KNOWN_CHECKPOINTS)}; or pass the path of a .pt or .safetensors file."
    )


def download_checkpoint(name: str = DEFAULT_CHECKPOINT, on_start: Callable[[], None] | None = None) -> Path:
    """Fetch a known checkpoint from the Hugging Face hub into its cache (a no-op when it is already
    there) and return its path. Fails at once when offline mode is on or the hub cannot be reached;
    `on_start` runs once the hub has answered, before the download (a line announcing it, never printed
    before an error that downloads nothing)."""
    filename = _known_filename(name)
    if hub_offline():
        raise CheckpointUnavailable(
            f"cannot download {name!r}: Hugging Face offline mode is on (HF_HUB_OFFLINE); unset it if this "
            f"machine has network access. {_fetch_by_hand(name)}"
        )
    endpoint = hub_endpoint()
    _check_hub_answers(name, endpoint)
    if on_start is not None:
        on_start()
    try:
        return Path(hf_hub_download(HF_REPO_ID, filename, cache_dir=hub_cache_dir(), endpoint=endpoint))
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as error:
        raise CheckpointUnavailable(_unreachable_message(name, endpoint, error)) from None
    except HfHubHTTPError as error:
        raise CheckpointError(
            f"downloading {name!r} from {HF_REPO_URL} failed: {error}. Try again later. {_fetch_by_hand(name)}"
        ) from None
    except OSError as error:
        raise CheckpointError(
            f"downloading {name!r} into {hub_cache_dir()} failed: {error}. The file is about 4.6 GB: check "
            "free disk space and permissions, or set HF_HOME to another folder."
        ) from None


def _check_hub_answers(name: str, endpoint: str) -> None:
    """One request to the hub before the download (hub_paths.hub_unreachable says why)."""
    error = hub_unreachable(hf_hub_url(HF_REPO_ID, KNOWN_CHECKPOINTS[name], endpoint=endpoint))
    if error is not None:
        raise CheckpointUnavailable(_unreachable_message(name, endpoint, error))


def _unreachable_message(name: str, endpoint: str, error: Exception) -> str:
    return (
        f"cannot download {name!r}: the Hugging Face hub at {endpoint} cannot be reached "
        f"({type(error).__name__}: {str(error).strip() or 'no detail'}). {_fetch_by_hand(name)} If this machine "
        "should reach the hub, check its network and proxy settings (HTTPS_PROXY, HF_ENDPOINT)."
    )


def _known_filename(name: str) -> str:
    try:
        return KNOWN_CHECKPOINTS[name]
    except KeyError:
        raise CheckpointError(
            f"unknown checkpoint name {name!r}; known: {', '.join(KNOWN_CHECKPOINTS)}"
        ) from None


def _not_on_this_machine_message(name: str) -> str:
    looked = (f"checkpoint {name!r} is not on this machine (looked in {checkpoint_dir()} and in the Hugging Face "
              f"cache {hub_cache_dir()})")
    if hub_offline():
        return (f"{looked}, and Hugging Face offline mode is on (HF_HUB_OFFLINE), so it is not downloaded. "
                f"{_fetch_by_hand(name)} If this machine has network access, unset HF_HUB_OFFLINE.")
    return (f"{looked}. Fetch it with `stream-recon download {name}` (or `hf download {HF_REPO_ID} "
            f"{KNOWN_CHECKPOINTS[name]}`). {_fetch_by_hand(name)}")


def _fetch_by_hand(name: str) -> str:
    """How to get the file without this machine downloading it (so never the download command, which
    fails where the hub cannot be reached)."""
    return (
        f"To fetch it by hand, download {_file_url(KNOWN_CHECKPOINTS[name])} (about {CHECKPOINT_SIZE}) on a machine with "
        f"network access and put it in {checkpoint_dir()}/ here (or set {CHECKPOINT_DIR_ENV} to the folder "
        "that holds it), or pass the file's path as the checkpoint."
    )


def _file_url(filename: str) -> str:
    """The file's direct download address on huggingface.co (a browser or curl fetches it)."""
    return f"{HF_REPO_URL}/resolve/main/{filename}"


def checkpoint_digest(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """sha256 of a file as hex, read in chunks (a 4.6 GB checkpoint never sits in memory).

    Hashing 4.6 GB takes seconds, so the result is remembered per process for an unchanged file
    (same path, size and modification time): a batch of runs on one checkpoint hashes it once.
    """
    path = existing_checkpoint_file(path).resolve()
    stat = path.stat()
    return _file_sha256(str(path), stat.st_size, stat.st_mtime_ns, chunk_bytes)


@lru_cache(maxsize=16)
def _file_sha256(path: str, size: int, mtime_ns: int, chunk_bytes: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
