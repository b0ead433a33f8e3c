"""The engine tests' shared helpers: random frames, the streamed predictions checked against
the model stepped over a list-based model of the spec's visible key set (tests/test_models_engine.py,
tests/test_models_budget.py), and a gate that holds a chunked engine's spare back
(tests/test_models_chunked.py, tests/test_gpu_fast_path.py), and a keyframe policy added as one file beside the
shipped ones (`policy_beside`)."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from stream_recon.models import StreamingEngine


def frames(count: int, height: int = 42, width: int = 56, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.rand(3, height, width, generator=generator) for _ in range(count)]


class DenseCache:
    """A readable, list-based model of the visible set (spec §5.3), used to check the paged one."""

    def __init__(self, scale_frames: int, window: int, specials: int):
        self.scale, self.window, self.specials = scale_frames, window, specials
        self.frames: dict[int, list] = {}  # layer -> list of (k, v) per committed frame
        self.num_new = 0

    def __call__(self, layer, q, k, v):
        committed = self.frames.setdefault(layer, [])
        per_frame = k.shape[0] // self.num_new
        new = [(k[i * per_frame:(i + 1) * per_frame], v[i * per_frame:(i + 1) * per_frame]) for i in range(self.num_new)]
        every = committed + new
        scale, rest = every[: self.scale], every[self.scale:][-self.window:]
        keys = [f[0][self.specials:] for f in scale + rest] + [f[0][: self.specials] for f in every]
        values = [f[1][self.specials:] for f in scale + rest] + [f[1][: self.specials] for f in every]
        keys, values = torch.cat(keys), torch.cat(values)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
        )
        committed += new
        return out[0].transpose(0, 1)


def assert_streams_like_the_visible_set_model(model, predictions, images, scale_frames: int, window: int,
                                              transform_kv=None) -> None:
    """The streamed predictions (every frame a keyframe) equal the model stepped over DenseCache,
    the list-based model of the spec's key set; `transform_kv` is applied to every K and V first."""
    from stream_recon.cache import TokenCache

    config = model.config
    dense = DenseCache(scale_frames, window, config.num_special_tokens)
    attention = dense if transform_kv is None else (
        lambda layer, q, k, v: dense(layer, q, transform_kv(k), transform_kv(v)))
    camera = TokenCache(model.camera_head.num_cache_layers, config.camera_heads,
                        config.head_in_dim // config.camera_heads, torch.float32, "cpu")
    batches = [torch.stack(images[:scale_frames])] + [image[None] for image in images[scale_frames:]]
    start = 0
    with torch.inference_mode():
        for batch in batches:
            n = batch.shape[0]
            dense.num_new = n
            camera.begin(n)
            indices = torch.arange(start, start + n)
            out = model.step(batch, attention, camera, indices, indices, scale_frames)
            camera.commit()
            for i in range(n):
                np.testing.assert_allclose(predictions[start + i].depth, out["depth"][i].numpy(), rtol=0, atol=2e-6)
                np.testing.assert_allclose(predictions[start + i].pose_enc, out["pose_enc"][i].numpy(), rtol=0, atol=2e-6)
            start += n


class SpareGate:
    """Holds the spare's worker thread at its next step until opened (StreamingEngine.push_checked
    patched: the spare is handed checked frames, and `push` goes through it too)."""

    def __init__(self, monkeypatch):
        self.open = threading.Event()
        self.open.set()
        push = StreamingEngine.push_checked

        def gated_push(engine, *args, **kwargs):
            if threading.current_thread().name.startswith("stream-recon-next-chunk"):
                assert self.open.wait(timeout=60), "the gate was never opened"
            return push(engine, *args, **kwargs)

        monkeypatch.setattr(StreamingEngine, "push_checked", gated_push)


# A policy that decides as another does and also reads the frame's tokens: the engine then makes each frame's
# descriptor (models/stream/keyframe_policy.py, TOKENS), and its steps otherwise are those of the other policy.
DESCRIBED_POLICY = '''"""`described:SPELLING`: as SPELLING's policy decides, reading the frame's tokens too."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stream_recon.models.stream.keyframe_policy import FLOW, TOKENS, FrameFacts, KeyframePolicy
from stream_recon.models.stream.keyframes import parse_keyframes


@dataclass(frozen=True)
class DescribedKeyframes(KeyframePolicy):
    inner: KeyframePolicy
    word: ClassVar[str] = "described"
    usage: ClassVar[str] = "described:SPELLING"
    reads: ClassVar[frozenset[str]] = frozenset({FLOW, TOKENS})

    def decided_before(self, frame: FrameFacts) -> bool | None:
        return self.inner.decided_before(frame)

    def decided_after(self, frame: FrameFacts) -> bool:
        return self.inner.decided_after(frame)

    @property
    def input_frames_per_cached_frame(self) -> int | None:
        return self.inner.input_frames_per_cached_frame

    @classmethod
    def from_argument(cls, argument, flow_threshold, max_gap):
        return cls(parse_keyframes(argument, flow_threshold, max_gap)) if argument else None
'''


@contextlib.contextmanager
def policy_beside(folder: Path, word: str, source: str) -> Iterator[None]:
    """The keyframe policy `source` written as `word`.py in `folder`, a folder of the keyframes package's path
    meanwhile: the table holds it as it holds the shipped ones (one file each)."""
    from stream_recon.models.stream import keyframes

    (folder / f"{word}.py").write_text(source)
    path = keyframes.__path__
    keyframes.__path__ = [*path, str(folder)]
    keyframes.keyframe_policies.cache_clear()
    keyframes._parse_spelling.cache_clear()
    try:
        yield
    finally:
        keyframes.__path__ = path
        keyframes.keyframe_policies.cache_clear()
        keyframes._parse_spelling.cache_clear()
        sys.modules.pop(f"stream_recon.models.stream.keyframes.{word}", None)
