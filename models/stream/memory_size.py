"""A memory size as people write it (`8GiB`, `7.5G`, `8GB`), read into bytes without torch: the CLI checks
--gpu-memory with it before it loads anything, and the memory plan (memory.py) takes the bytes it gives."""

from __future__ import annotations

import re

# A unit's bytes: G and M (as GiB, MiB) are binary, GB and MB decimal
_UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20, "mb": 10**6,
          "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40, "tb": 10**12}


def parse_memory_size(text: str) -> int:
    """Bytes from a size as people write it: `8GiB`, `7.5G` (binary), `8GB` (decimal), `8192MiB`,
    or a plain number of bytes. Raises ValueError naming the accepted forms."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"cannot read {text!r} as a memory size: use a positive number with GiB, MiB, GB, MB (or G, "
                         "M: binary), e.g. 8GiB")
    return int(float(match.group(1)) * _UNITS[unit])
