"""The engine tests' shared helpers: random frames, the streamed predictions checked against
the model stepped over a list-based model of the spec's visible key set (tests/test_models_engine.py,
tests/test_models_budget.py), and a gate that holds a chunked engine's spare back
(tests/test_models_chunked.py, tests/test_gpu_fast_path.py)."""

from __future__ import annotations

import threading

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
