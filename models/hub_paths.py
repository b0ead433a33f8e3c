"""Where checkpoints live on this machine and how the Hugging Face hub is reached, read from the environment
when asked: free of torch, so that a command that only reads a run directory (`export`, its sky masks) starts
without torch's import (2.5 s of CPU on a 2-core machine). checkpoint.py loads, converts and downloads."""

from __future__ import annotations

import os
from pathlib import Path

from huggingface_hub import constants as hf_constants
from huggingface_hub import get_hf_file_metadata
from huggingface_hub.errors import HfHubHTTPError

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
