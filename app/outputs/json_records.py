"""JSON records (run.json, eval.json, a batch's marker) written as strict UTF-8 and read back exactly.

Its own module because the rule it keeps, a string that is not UTF-8 written readable and exactly, is about
JSON, not about where a run's files lie; the writer, the evaluation and the batch all write through it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from stream_recon.app.outputs.atomic_writes import atomic_write

# A path whose bytes are not UTF-8 (a folder named on another system) reaches Python with lone surrogates
# (os.fsdecode), which json writes as "\udcff": JSON that strict readers (serde, Go, jq --seq) refuse. Such a
# string is written readable, each byte that is not UTF-8 as \xNN, and exactly, its bytes in hex, under
# NOT_UTF8_KEY, by where it is ("settings/source_location"); read_run_info puts it back as it was.
NOT_UTF8_KEY = "not_utf8"


def write_json_atomic(path: Path, data: dict) -> None:
    text = json.dumps(utf8_record(data), indent=2) + "\n"
    atomic_write(path, lambda f: f.write(text), binary=False)


def utf8_record(data: dict) -> dict:
    """data as JSON types, every string strict UTF-8: one that is not written readable (\\xNN for each such
    byte) and exactly, in hex under NOT_UTF8_KEY (absent when there is none); exact_strings reads it back."""
    exact: dict[str, str] = {}
    readable = _utf8_only(json.loads(json.dumps(data, default=_json_default)), "", exact)
    if exact:
        readable[NOT_UTF8_KEY] = exact
    return readable


def _utf8_only(value: Any, where: str, exact: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {_utf8_key(key): _utf8_only(item, f"{where}/{key}".lstrip("/"), exact) for key, item in value.items()}
    if isinstance(value, list):
        return [_utf8_only(item, f"{where}/{index}", exact) for index, item in enumerate(value)]
    if isinstance(value, str) and not _is_utf8(value):
        exact[where] = os.fsencode(value).hex()
        return os.fsencode(value).decode("utf-8", "backslashreplace")
    return value


def _utf8_key(key: str) -> str:
    return key if _is_utf8(key) else os.fsencode(key).decode("utf-8", "backslashreplace")


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def exact_strings(data: dict) -> dict:
    """data with each string NOT_UTF8_KEY holds put back (utf8_record)."""
    for where, hex_bytes in (data.pop(NOT_UTF8_KEY, None) or {}).items():
        *parents, last = where.split("/")
        holder: Any = data
        try:
            for part in parents:
                holder = holder[int(part)] if isinstance(holder, list) else holder[part]
            holder[int(last) if isinstance(holder, list) else last] = os.fsdecode(bytes.fromhex(hex_bytes))
        except (KeyError, IndexError, ValueError, TypeError):
            continue  # a record edited by hand: the readable string stays
    return data


def _json_default(value: Any) -> Any:
    # Settings carry Paths, numpy scalars and small arrays; everything else is written as its repr.
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return repr(value)
