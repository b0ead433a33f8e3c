"""What a keyframe policy is: `KeyframePolicy`, the questions the engines ask of one, and `FrameFacts`, what
the engine tells it of a frame. The policies themselves are files of keyframes/ (a file each, the folder their
table).

A policy says what it reads of a frame beyond its place and time (`reads`: the camera-motion flow to the last
keyframe, the frame's prediction, its tokens), and the engine supplies exactly that: the flow is computed,
the descriptor of the frame's tokens made in its step, only where the policy reads them. So a policy that
decides from any of these is one file, and the engine never names one.

Free of torch and NumPy at import: `-h` reads the policies' spellings.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

# What a policy may read of a streaming frame once its step is done (KeyframePolicy.reads):
FLOW = "flow"  # the mean camera-motion flow of its prediction to the last keyframe's, pixels
PREDICTION = "prediction"  # its prediction's host arrays: pose_enc, c2w, intrinsics, depth, depth_conf, image
TOKENS = "tokens"  # its tokens, as the network's descriptor of them (GeM of its DINO patch tokens, [C], unit length)
SIGNALS = (FLOW, PREDICTION, TOKENS)


@dataclass(frozen=True)
class FrameFacts:
    """A streaming frame as its policy sees it: its place and time always; before its step nothing more; after
    it, what the policy reads (None where it reads it not)."""

    index: int  # its stream index (the first streaming frame's is scale_frames)
    scale_frames: int
    timestamp: float  # seconds, the source's
    last_key_index: int  # the last keyframe's (the last scale frame's before any streaming keyframe)
    last_key_timestamp: float
    flow: float | None = None
    prediction: Mapping[str, Any] | None = None  # name -> array of its first (only) row
    tokens: Any = None  # [C] float32 array


class KeyframePolicy(ABC):
    """Which streaming frames stay in the cache (the scale frames always do): what the engine and the
    chunked engine ask of a policy. A policy is a frozen subclass in a file of keyframes/ named after its
    `word`, the word `--keyframes` spells it with; nothing else names one.

    The engine asks `decided_before` before each streaming step and, where that answers None, asks
    `decided_after` once the frame's prediction is on the host, with what `reads` names; both run once a frame,
    so they compute and allocate nothing beyond the answer."""

    # The word before any ':' in the policy's spelling (its file's name), and how its help and errors show
    # that spelling.
    word: ClassVar[str]
    usage: ClassVar[str]
    # What `decided_after` reads of the frame beyond its place and time (of SIGNALS).
    reads: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def decided_before(self, frame: FrameFacts) -> bool | None:
        """Whether streaming frame `frame` is a keyframe, when that is known before its step (None: it is
        decided afterwards, from what the step made of the frame, by `decided_after`)."""

    def decided_after(self, frame: FrameFacts) -> bool:
        """Whether streaming frame `frame` is a keyframe, from what `reads` names; asked only where
        `decided_before` said None, so a policy that decides before the step answers the same here."""
        return bool(self.decided_before(frame))

    @property
    def input_frames_per_cached_frame(self) -> int | None:
        """Input frames a cached streaming frame stands for when the rule fixes it (a chunk's length is
        then known when it opens); None where the video decides."""
        return None

    @property
    def closes_on_keyframes(self) -> bool:
        """A chunk closes at its last keyframe, known only when that frame comes (no fixed length)."""
        return self.input_frames_per_cached_frame is None

    @property
    def reads_flow_threshold(self) -> bool:
        """The flow settings (--flow-threshold, --max-gap) change its decisions."""
        return False

    @classmethod
    def from_argument(cls, argument: str | None, flow_threshold: float, max_gap: int) -> KeyframePolicy | None:
        """The policy its spelling names, `argument` the text after the ':' (None: no ':'); None where
        the argument is not one it takes."""
        return cls() if argument is None else None
