"""The keyframe policies: one file each in this folder, and the table they make.

A policy's file is named after its word (`--keyframes WORD[:ARGUMENT]`) and holds its class, a frozen
KeyframePolicy (models/stream/keyframe_policy.py) that says what it reads of a frame and decides from it. The
table is the folder: this module lists its files (every folder of the package's path: a policy added beside
them is one file) and imports each for the policy whose `word` is the file's name. Adding a policy is one file
here (docs/ARCHITECTURE.md, "How to add").

Free of torch and NumPy: `-h` and the app's option check read the spellings.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

from ..keyframe_policy import KeyframePolicy
from .flow import FLOW_THRESHOLD, MAX_GAP


def names() -> tuple[str, ...]:
    """The policies' words: the files of the package's folders, in name order."""
    return tuple(sorted({path.stem for folder in __path__ for path in Path(folder).glob("*.py")
                         if not path.stem.startswith("_")}))


@functools.cache
def keyframe_policies() -> dict[str, type[KeyframePolicy]]:
    """The policies `--keyframes` takes, a row each: the word before any ':' of a spelling -> its policy, in
    the order help texts and errors list them (the files')."""
    table = {}
    for name in names():
        module = importlib.import_module(f".{name}", __name__)
        found = [value for value in vars(module).values() if isinstance(value, type)
                 and issubclass(value, KeyframePolicy) and value.__module__ == module.__name__]
        if [policy.word for policy in found] != [name]:
            raise ImportError(f"models/stream/keyframes/{name}.py must hold one keyframe policy, whose word is the "
                              f"file's name ({name!r}); it holds {[policy.__name__ for policy in found]}")
        table[name] = found[0]
    return table


def keyframe_spellings() -> str:
    """'all, flow or interval:N (N >= 1)': every spelling, for help texts and errors."""
    usages = [policy.usage for policy in keyframe_policies().values()]
    return f"{', '.join(usages[:-1])} or {usages[-1]}" if len(usages) > 1 else usages[0]


def parse_keyframes(text: str, flow_threshold: float = FLOW_THRESHOLD, max_gap: int = MAX_GAP) -> KeyframePolicy:
    """The policy `text` spells (`all`, `flow`, `interval:N`; any case, spaces around it), the flow settings
    given to the policies that read them. ValueError for a spelling no row takes."""
    return _parse_spelling(text, flow_threshold, max_gap)


# Memoised: a run reads one spelling in several places (the app's option check, the StreamConfig a
# ChunkedEngine is given and the copies dataclasses.replace makes of it for its chunks and its spare),
# and it is parsed once; every reader gets the same frozen policy. A spelling that is refused raises
# again each time (an error is not cached).
@functools.lru_cache(maxsize=16)
def _parse_spelling(text: str, flow_threshold: float, max_gap: int) -> KeyframePolicy:
    word, colon, argument = text.strip().lower().partition(":")
    policy_class = keyframe_policies().get(word)
    policy = policy_class.from_argument(argument if colon else None, flow_threshold, max_gap) if policy_class else None
    if policy is None:
        raise ValueError(f"unknown keyframe policy {text.strip().lower()!r}: use {keyframe_spellings()}")
    return policy
