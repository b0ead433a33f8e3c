"""Shared helpers for the golden-fixture tests (official outputs on deterministic weights)."""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from typer.testing import CliRunner

from stream_recon.app.cli import app, with_default_command

GOLDEN = Path(__file__).parent / "golden"
TOLERANCE = 1e-3  # fixtures README §5: max |ours - golden| / std(golden)


def relative_error(ours: np.ndarray, golden: np.ndarray, axis=None) -> np.ndarray:
    """max |o - g| / (std(g) + 1e-12), over all elements (axis None) or per component."""
    ours, golden = np.asarray(ours, dtype=np.float64), np.asarray(golden, dtype=np.float64)
    return np.abs(ours - golden).max(axis=axis) / (golden.std(axis=axis) + 1e-12)


def golden_frames() -> torch.Tensor:
    """The 14 model inputs [14, 3, 126, 224] float32, bit-identical to the official tensor."""
    images = np.load(GOLDEN / "inputs" / "preprocessed.npz")["images_u8"]
    return torch.from_numpy(images.astype(np.float32) / np.float32(255))


def golden_settings(scenario: str) -> dict:
    return json.loads((GOLDEN / scenario / "settings.json").read_text())


@lru_cache(maxsize=1)
def full_size_model():
    """The official architecture with the fixtures' synthetic weights, float32, CPU."""
    from stream_recon.models import GCTStream, ModelConfig
    from stream_recon.models.synthetic import load_synthetic_weights

    torch.manual_seed(0)
    with torch.device("meta"):
        model = GCTStream(ModelConfig())
    model = model.to_empty(device="cpu")
    load_synthetic_weights(model)
    return model.eval()


@lru_cache(maxsize=1)
def prepared_full_size_model():
    """full_size_model() prepared for streaming on the CPU in float32 (it shares the weights)."""
    from stream_recon.models import prepare_for_inference

    return prepare_for_inference(full_size_model(), "cpu", torch.float32)


class Capture:
    """Keeps the first output of a module (the phase-1 step) without changing it."""

    def __init__(self, module):
        self.value = None
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        if self.value is None:
            self.value = [o.detach().clone() for o in output] if isinstance(output, (list, tuple)) else output.detach().clone()


def phase1_captures(model) -> dict[str, Capture]:
    """Captures of the phase-1 step's intermediates that tests/golden/phase1_intermediates holds: the DINO patch
    tokens, the aggregator's layers and the camera head's iterations (remove each handle when done)."""
    return {"dino": Capture(model.aggregator.patch_embed), "aggregator": Capture(model.aggregator),
            "camera": Capture(model.camera_head)}


def assert_phase1_intermediates(captured: dict[str, object]) -> None:
    """The first step's intermediates (phase1_captures' values) against the fixture, frame 0's where per frame."""
    golden = np.load(GOLDEN / "phase1_intermediates" / "intermediates.npz")
    checks = {
        "dino_patch_tokens_f0": captured["dino"][0],
        "agg_layers_f0": torch.stack([layer[0] for layer in captured["aggregator"]]),
        "pose_enc_list": torch.stack(captured["camera"]),
    }
    for key, ours in checks.items():
        err = relative_error(ours.numpy(), golden[key])
        assert err <= TOLERANCE, f"{key}: error {err:.2e}"


def every_golden_check() -> bool:
    """STREAM_RECON_GOLDEN=all: every golden computation, also the engine's own flow stream, which the CLI's
    flow scenario computes once already."""
    return os.environ.get("STREAM_RECON_GOLDEN") == "all"


def cache_state(engine, time_before: int) -> tuple[int, int, int, int, int]:
    """The state assert_cache_states reads, of `engine` after a push that began at time index `time_before`."""
    stats = engine.stats()
    return time_before, engine.time_counter, stats["patch_frames"], stats["cached_frames"], stats["camera_tokens"]


def assert_cache_states(states: list[tuple[int, int, int, int, int]], golden) -> None:
    """An engine's cache state after each frame it was handed, (time index before, after, patch frames, cached
    frames, camera tokens), against a fixture's `after_*` lists (from frame 2, the end of phase 1: scale frames 0 and
    1 are buffered, not yet run)."""
    streaming = states[2:]
    assert [s[1] for s in streaming] == golden["after_rope_counter"][2:].tolist()
    assert [s[2] for s in streaming] == golden["after_patch_frames"][2:].tolist()
    assert [s[3] for s in streaming] == golden["after_special_frames"][2:].tolist()
    assert [s[4] for s in streaming] == golden["after_camera_tokens"][2:].tolist()
    assert [s[0] for s in states[3:]] == golden["rope_time_index"][3:].tolist()


def assert_flow_magnitudes(predictions, golden) -> None:
    """Each frame's flow to its keyframe where the fixture's policy decided one, none where it did not."""
    flows = np.array([p.flow_magnitude for p in sorted(predictions, key=lambda p: p.frame_index)])
    decided = ~np.isnan(golden["flow_magnitude"])
    assert np.isnan(flows[~decided]).all()
    error = relative_error(flows[decided], golden["flow_magnitude"][decided])
    assert error <= TOLERANCE, f"flow magnitude error {error:.2e}"


class EngineSteps:
    """What every StreamingEngine of a run showed after each frame it was handed: its cache state (as
    assert_cache_states reads it) and the predictions it returned. It wraps the engine's `push_checked` and `finish`
    for the test (monkeypatch), calling each as it is: the run computes and writes exactly what it would."""

    def __init__(self, monkeypatch):
        from stream_recon.models import StreamingEngine

        self.engines: dict[object, tuple[list, list]] = {}  # engine -> (states, predictions)
        push, finish = StreamingEngine.push_checked, StreamingEngine.finish

        def recording_push(engine, image, timestamp=None, **options):
            before = engine.time_counter
            ready = push(engine, image, timestamp, **options)
            states, predictions = self.engines.setdefault(engine, ([], []))
            states.append(cache_state(engine, before))
            predictions += ready
            return ready

        def recording_finish(engine):
            ready = finish(engine)
            self.engines.setdefault(engine, ([], []))[1].extend(ready)
            return ready

        monkeypatch.setattr(StreamingEngine, "push_checked", recording_push)
        monkeypatch.setattr(StreamingEngine, "finish", recording_finish)

    def stream(self, frames: int) -> tuple[list, list]:
        """(states, predictions) of the one engine that was handed `frames` frames: the stream's."""
        handed = [record for record in self.engines.values() if len(record[0]) == frames]
        assert len(handed) == 1, f"engines handed {[len(states) for states, _ in self.engines.values()]} frames"
        return handed[0]


# -- the CLI on the golden frames (tests/test_golden_cli.py, and the GPU suite) --------------------
SCENARIO_OPTIONS = {
    "all_keyframes": ["--keyframes", "all"],
    "interval_2": ["--keyframes", "interval:2"],
    "flow": ["--keyframes", "flow", "--flow-threshold", "43", "--max-gap", "3"],
}
FLOAT_KEYS = ("pose_enc", "c2w", "intrinsics", "depth", "depth_conf")


def run_cli_on_golden_frames(checkpoint: Path, frames: Path, output: Path, scenario: str, *extra: str) -> Path:
    args = [str(frames), "--output", str(output), "--checkpoint", str(checkpoint), "--scale-frames", "3",
            "--window", "4", "--image-width", "224", "--no-viewer", *SCENARIO_OPTIONS[scenario],
            # the model's float32 outputs as computed: float16 storage (the default) rounds by up to 2**-11,
            # which is 0.3 sigma of the synthetic weights' nearly flat depth maps
            "--save-depth", "float32", *extra]
    result = CliRunner().invoke(app, with_default_command(args))
    if result.exit_code != 0:
        import traceback

        trace = "".join(traceback.format_exception(*result.exc_info)) if result.exc_info else ""
        raise AssertionError(f"exit {result.exit_code}: {result.output}\n{getattr(result, 'stderr', '')}\n{trace}")
    return output


def compare_run_with_golden(run_dir: Path, scenario: str, limits: dict[str, float] | None = None) -> dict[str, float]:
    """Max error per key (fixtures §5 metric) of the run's npz files against the golden outputs;
    asserts the keyframe flags exactly and each error within `limits` (default: float32's 1e-3)."""
    golden = np.load(GOLDEN / scenario / "outputs.npz")
    files = sorted((run_dir / "predictions").glob("*.npz"))
    assert [int(path.stem) for path in files] == list(range(14))
    ours = [dict(np.load(path)) for path in files]
    assert [bool(p["is_keyframe"]) for p in ours] == golden["is_keyframe"].tolist()
    assert [int(p["frame_type"]) for p in ours] == golden["frame_type"].tolist()
    errors = {"pose_enc": float(relative_error(np.stack([p["pose_enc"] for p in ours]), golden["pose_enc"],
                                               axis=0).max())}
    for key in FLOAT_KEYS[1:]:
        errors[key] = float(relative_error(np.stack([p[key] for p in ours]), golden[key]))
    limits = limits or dict.fromkeys(FLOAT_KEYS, TOLERANCE)
    print(f"{run_dir.name} vs golden {scenario}: {errors}")
    for key, limit in limits.items():
        assert errors[key] <= limit, f"{key}: {errors[key]:.2e} sigma > {limit}"
    return errors
