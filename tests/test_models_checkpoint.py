"""Checkpoint IO: round trips through the streaming engine, every refusal, and name resolution through a
real Hugging Face cache layout. Only the remote download itself is mocked."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from huggingface_hub.errors import LocalEntryNotFoundError
from media_helpers import free_port
from safetensors import safe_open

from stream_recon.models import (
    CheckpointError,
    GCTStream,
    ModelConfig,
    StreamConfig,
    StreamingEngine,
    hub_paths,
    load_model,
    prepare_for_inference,
)
from stream_recon.models import checkpoint as ckpt
from stream_recon.models.checkpoint import (
    CONFIG_METADATA_KEY,
    SOURCE_DIGEST_METADATA_KEY,
    check_state_dict,
    checkpoint_config,
    convert_to_safetensors,
    read_state_dict,
)
from stream_recon.models.hub_paths import (
    HF_REPO_ID,
    HF_REPO_URL,
    KNOWN_CHECKPOINTS,
    checkpoint_digest,
    download_checkpoint,
    resolve_checkpoint,
)

GOLDEN_KEYS = Path(__file__).parent / "golden" / "checkpoint_keys.tsv"
TINY = ModelConfig.tiny()
REVISION = "0123456789abcdef0123456789abcdef01234567"

UNPICKLED = []  # filled only if a refused pickle's object were ever rebuilt


class PickledObject:
    """A custom class in a checkpoint: weights_only must refuse it without rebuilding it."""

    def __setstate__(self, state):
        UNPICKLED.append(state)


@pytest.fixture(autouse=True)
def isolated_caches(tmp_path, monkeypatch):
    """No test may see (or write to) the real checkpoint folder or Hugging Face cache."""
    for variable in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("STREAM_RECON_CHECKPOINTS", str(tmp_path / "own-checkpoints"))


@pytest.fixture(scope="module")
def tiny_state_dict(tiny_model) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in tiny_model.state_dict().items()}


@pytest.fixture(scope="module")
def reference_outputs(tiny_model):
    return stream_outputs(tiny_model)


@pytest.fixture
def tiny_pt(tmp_path, tiny_state_dict) -> Path:
    path = tmp_path / "tiny.pt"
    torch.save(tiny_state_dict, path)
    return path


def stream_outputs(model: GCTStream) -> list[tuple]:
    """Per-frame outputs of a short stream (2 scale frames, then one frame per step) on fixed frames."""
    generator = torch.Generator().manual_seed(1)
    frames = torch.rand(4, 3, 28, 42, generator=generator)
    engine = StreamingEngine(prepare_for_inference(model, "cpu"), StreamConfig(scale_frames=2, window=4))
    predictions = [pred for index, frame in enumerate(frames) for pred in engine.push(frame, timestamp=index)]
    predictions += engine.finish()
    return [(p.frame_index, p.pose_enc, p.depth, p.depth_conf) for p in predictions]


def assert_same_outputs(ours, reference):
    assert len(ours) == len(reference) == 4
    for (index, pose, depth, conf), (ref_index, ref_pose, ref_depth, ref_conf) in zip(ours, reference, strict=True):
        assert index == ref_index
        np.testing.assert_array_equal(pose, ref_pose)
        np.testing.assert_array_equal(depth, ref_depth)
        np.testing.assert_array_equal(conf, ref_conf)


def assert_ready_for_inference(model: GCTStream):
    assert not model.training
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 and not p.requires_grad
               for p in model.parameters())


def make_hub_cache(hub: Path, filename: str, payload: Path) -> Path:
    """huggingface_hub's own cache layout: a blob named by its hash, a snapshot symlink, refs/main."""
    repo = hub / "models--robbyant--lingbot-map"
    blob = repo / "blobs" / hashlib.sha256(payload.read_bytes()).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(payload.read_bytes())
    snapshot = repo / "snapshots" / REVISION / filename
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    snapshot.symlink_to(Path("..") / ".." / "blobs" / blob.name)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


# -- round trips -------------------------------------------------------------------------------------

@pytest.mark.parametrize("wrapped", [False, True], ids=["bare", "model-key"])
def test_pt_round_trip_gives_identical_stream_outputs(tmp_path, tiny_state_dict, reference_outputs, wrapped):
    path = tmp_path / "weights.pt"
    torch.save({"model": tiny_state_dict, "epoch": 7} if wrapped else tiny_state_dict, path)
    model = load_model(path, config=TINY)
    assert_ready_for_inference(model)
    assert_same_outputs(stream_outputs(model), reference_outputs)


def test_dtype_casts_every_parameter(tiny_pt, tiny_state_dict):
    model = load_model(tiny_pt, config=TINY, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    name = "aggregator.scale_token"
    assert torch.equal(model.state_dict()[name], tiny_state_dict[name].to(torch.bfloat16))


def test_legacy_non_zip_pt_loads_without_mmap(tmp_path, tiny_state_dict, reference_outputs):
    path = tmp_path / "legacy.pth"
    torch.save(tiny_state_dict, path, _use_new_zipfile_serialization=False)
    assert path.read_bytes()[:4] != b"PK\x03\x04"
    assert_same_outputs(stream_outputs(load_model(path, config=TINY)), reference_outputs)


def test_safetensors_round_trip_restores_config_from_metadata(tmp_path, tiny_pt, reference_outputs):
    converted = convert_to_safetensors(tiny_pt, tmp_path / "tiny.safetensors", config=TINY)
    assert converted == tmp_path / "tiny.safetensors"
    assert checkpoint_config(converted) == TINY
    model = load_model(converted)  # no config given: it comes from the file
    assert model.config == TINY
    assert_ready_for_inference(model)
    assert_same_outputs(stream_outputs(model), reference_outputs)


def resident_bytes_of(path: Path) -> int:
    """Bytes of `path` mapped into this process and resident in memory (the Rss of its mappings)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping's first line ends with its file's path
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


@pytest.mark.slow
def test_safetensors_load_holds_a_bounded_piece_of_the_file_beside_the_parameters(tmp_path, tiny_pt, monkeypatch,
                                                                                   reference_outputs):
    # Keeping the whole file mapped, its pages resident, beside aligned copies of its tensors would peak
    # host memory at twice the checkpoint: each open of the file reads one piece.
    converted = convert_to_safetensors(tiny_pt, tmp_path / "tiny.safetensors", config=TINY)
    piece_bytes = 1 << 20
    monkeypatch.setattr(ckpt, "READ_PIECE_BYTES", piece_bytes)
    opens = []  # per open of the file: [bytes of the tensors taken from it, bytes of it resident at its close]

    class MeasuredSafeOpen:
        """safetensors' own reader, measured."""

        def __init__(self, *args, **kwargs):
            self.file = safe_open(*args, **kwargs)
            opens.append([0, 0])

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            opens[-1][1] = resident_bytes_of(converted)
            return self.file.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def get_tensor(self, name):
            tensor = self.file.get_tensor(name)
            opens[-1][0] += tensor.nbytes
            return tensor

    monkeypatch.setattr(ckpt, "safe_open", MeasuredSafeOpen)
    model = load_model(converted)
    largest = max(p.nbytes for p in model.parameters())
    total = sum(p.nbytes for p in model.parameters())
    # the check of names and shapes takes views of every tensor (their data untouched) in one open
    pieces = [(taken, resident) for taken, resident in opens if 0 < taken < total]
    assert sum(taken for taken, _ in pieces) == total and max(taken for taken, _ in pieces) <= piece_bytes + largest
    page_faults_map_more = 2 * (2 << 20)  # a fault maps pages around it: up to a 2 MiB folio at either end
    assert max(resident for _, resident in pieces) <= piece_bytes + largest + page_faults_map_more, opens
    assert resident_bytes_of(converted) == 0 and str(converted) not in Path("/proc/self/maps").read_text()
    for parameter in model.parameters():  # memory of its own, 64-byte aligned like a .pt's tensors
        assert parameter.untyped_storage().nbytes() == parameter.nbytes and parameter.data_ptr() % 64 == 0
    assert_same_outputs(stream_outputs(model), reference_outputs)


def test_convert_records_config_and_source_digest(tmp_path, tiny_pt, tiny_state_dict):
    converted = convert_to_safetensors(tiny_pt, tmp_path / "tiny.safetensors", config=TINY)
    with safe_open(converted, framework="pt") as file:
        metadata = file.metadata()
        assert set(file.keys()) == set(tiny_state_dict)
        torch.testing.assert_close(file.get_tensor("depth_head.scratch.output_conv2.2.bias"),
                                   tiny_state_dict["depth_head.scratch.output_conv2.2.bias"], rtol=0, atol=0)
    assert ModelConfig.from_dict(json.loads(metadata[CONFIG_METADATA_KEY])) == TINY
    assert metadata[SOURCE_DIGEST_METADATA_KEY] == hashlib.sha256(tiny_pt.read_bytes()).hexdigest()
    assert checkpoint_digest(tiny_pt, chunk_bytes=1000) == metadata[SOURCE_DIGEST_METADATA_KEY]
    tiny_pt.write_bytes(b"changed")  # a remembered digest must not outlive the file's contents
    assert checkpoint_digest(tiny_pt) == hashlib.sha256(b"changed").hexdigest()
    assert list(tmp_path.glob(".*partial")) == []


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_converted_file_mode_follows_the_umask(tmp_path, tiny_pt, umask):
    # Not 0600 whatever the umask: a shared checkpoint must be readable by the others the umask allows
    previous = os.umask(umask)
    try:
        converted = convert_to_safetensors(tiny_pt, tmp_path / "tiny.safetensors", config=TINY)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(converted.stat().st_mode) == 0o666 & ~umask


def test_convert_refuses_a_checkpoint_of_another_model_and_writes_nothing(tmp_path, tiny_pt):
    destination = tmp_path / "full.safetensors"
    with pytest.raises(CheckpointError, match="wrong shape") as error:
        convert_to_safetensors(tiny_pt, destination)  # official config: the tiny tensors do not fit
    assert "another model configuration" in str(error.value)
    assert not destination.exists() and list(tmp_path.glob(".*partial")) == []
    with pytest.raises(CheckpointError, match=r"must end in \.safetensors"):
        convert_to_safetensors(tiny_pt, tmp_path / "out.pt", config=TINY)


def test_safetensors_without_our_metadata_uses_the_official_config(tmp_path, tiny_state_dict):
    from safetensors.torch import save_file

    path = tmp_path / "foreign.safetensors"
    save_file(tiny_state_dict, path)
    assert checkpoint_config(path) is None
    with pytest.raises(CheckpointError, match="wrong shape"):
        load_model(path)
    assert load_model(path, config=TINY).config == TINY


# -- refusals ------------------------------------------------------------------------------------------

def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint file not found: .*absent.pt"):
        read_state_dict(tmp_path / "absent.pt")
    with pytest.raises(CheckpointError, match="checkpoint file not found"):
        load_model(tmp_path / "absent.safetensors")
    with pytest.raises(CheckpointError, match="is a folder"):
        read_state_dict(tmp_path)


def test_wrong_key_is_named_as_missing_and_unexpected(tmp_path, tiny_state_dict):
    renamed = dict(tiny_state_dict)
    renamed["camera_head.typo_token"] = renamed.pop("aggregator.camera_token")
    path = tmp_path / "renamed.pt"
    torch.save(renamed, path)
    with pytest.raises(CheckpointError) as error:
        load_model(path, config=TINY)
    message = str(error.value)
    shape = f"[1, 2, 1, {TINY.embed_dim}]"
    assert f"1 missing (aggregator.camera_token {shape}), 1 unexpected (camera_head.typo_token {shape})" in message
    assert f"missing from the checkpoint (name, model shape):\n  aggregator.camera_token [1, 2, 1, {TINY.embed_dim}]" in message
    assert f"unexpected in the checkpoint (name, checkpoint shape):\n  camera_head.typo_token [1, 2, 1, {TINY.embed_dim}]" in message
    assert "allow_partial=True" in message


def test_wrong_shape_is_named_with_both_shapes(tmp_path, tiny_state_dict):
    broken = dict(tiny_state_dict)
    broken["aggregator.scale_token"] = torch.zeros(1, 2, 1, 7)
    path = tmp_path / "shape.pt"
    torch.save(broken, path)
    with pytest.raises(CheckpointError) as error:
        load_model(path, config=TINY)
    assert f"aggregator.scale_token: [1, 2, 1, 7] -> [1, 2, 1, {TINY.embed_dim}]" in str(error.value)
    assert "1 with the wrong shape" in str(error.value)


def test_integer_tensor_for_a_float_parameter_is_refused(tiny_model, tiny_state_dict):
    broken = dict(tiny_state_dict)
    broken["aggregator.scale_token"] = broken["aggregator.scale_token"].to(torch.int8)
    with pytest.raises(CheckpointError, match="aggregator.scale_token: int8"):
        check_state_dict(tiny_model, broken)


def test_long_problem_lists_are_truncated_with_a_count(tiny_model, tiny_state_dict):
    prefixed = {f"module.{name}": tensor for name, tensor in tiny_state_dict.items()}
    with pytest.raises(CheckpointError) as error:
        check_state_dict(tiny_model, prefixed, source="prefixed.pt")
    message = str(error.value)
    total = len(tiny_state_dict)
    assert message.startswith("prefixed.pt: ")
    assert f"0 tensors match; {total} missing, {total} unexpected" in message
    assert message.count(f"... and {total - ckpt.NAMES_SHOWN} more") == 2
    assert "is this a LingBot-Map checkpoint?" in message


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_truncated_file_is_reported_as_truncated(tmp_path, tiny_pt, suffix):
    source = tiny_pt
    if suffix == ".safetensors":
        source = convert_to_safetensors(tiny_pt, tmp_path / "whole.safetensors", config=TINY)
    data = source.read_bytes()
    cut = tmp_path / f"cut{suffix}"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt") as error:
        load_model(cut, config=TINY)
    assert f"{len(data) // 2:,} bytes" in str(error.value)


def test_legacy_truncated_empty_and_foreign_files(tmp_path, tiny_state_dict):
    legacy = tmp_path / "legacy.pt"
    torch.save(tiny_state_dict, legacy, _use_new_zipfile_serialization=False)
    cut = tmp_path / "legacy-cut.pt"
    cut.write_bytes(legacy.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        read_state_dict(cut)
    empty = tmp_path / "empty.pt"
    empty.touch()
    with pytest.raises(CheckpointError, match="is empty"):
        read_state_dict(empty)
    page = tmp_path / "page.pt"
    page.write_text("<html>Too many requests</html>")
    with pytest.raises(CheckpointError, match="not a PyTorch checkpoint"):
        read_state_dict(page)
    with pytest.raises(CheckpointError, match="unsupported checkpoint type '.bin'"):
        read_state_dict(legacy.rename(tmp_path / "weights.bin"))


def test_pickled_custom_object_is_refused_without_being_rebuilt(tmp_path, tiny_state_dict):
    path = tmp_path / "unsafe.pt"
    torch.save({**tiny_state_dict, "extra": PickledObject()}, path)
    UNPICKLED.clear()
    with pytest.raises(CheckpointError) as error:
        load_model(path, config=TINY)
    message = str(error.value)
    assert UNPICKLED == []
    assert "contains arbitrary Python objects" in message and "will not be loaded" in message
    assert f"{__name__}.PickledObject" in message
    assert "weights_only=False" in message and "unsafe.tensors.pt" in message


def test_non_tensor_values_are_named(tmp_path, tiny_state_dict):
    path = tmp_path / "mixed.pt"
    torch.save({**tiny_state_dict, "epoch": 3, "notes": "best"}, path)
    with pytest.raises(CheckpointError, match=r"2 entries that are not tensors: epoch \(int\), notes \(str\)"):
        read_state_dict(path)


def test_not_a_state_dict(tmp_path):
    path = tmp_path / "list.pt"
    torch.save([torch.zeros(2)], path)
    with pytest.raises(CheckpointError, match="holds a list, not a state dict"):
        read_state_dict(path)
    torch.save({"model": {}}, path)
    with pytest.raises(CheckpointError, match="empty state dict"):
        read_state_dict(path)
    torch.save({3: torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match="keys are parameter names"):
        read_state_dict(path)


def overwrite_tensor_bytes(path: Path, tensor: torch.Tensor, new_bytes: bytes) -> None:
    """Overwrite the middle of `tensor`'s data in a checkpoint file, as a damaged disk or download would."""
    data = bytearray(path.read_bytes())
    start = bytes(data).find(tensor.numpy().tobytes())
    assert start >= 0, "the tensor's bytes are stored as they are in memory"
    middle = start + (tensor.nbytes - len(new_bytes)) // 2
    data[middle:middle + len(new_bytes)] = new_bytes
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_corrupted_data_bytes_are_refused_naming_the_tensor(tmp_path, tiny_pt, tiny_state_dict, suffix):
    # 64 KiB of random bytes over a tensor's data must be refused at the load, not make every output NaN
    path = tiny_pt if suffix == ".pt" else convert_to_safetensors(tiny_pt, tmp_path / "tiny.safetensors", config=TINY)
    name = "camera_head.trunk.0.mlp.fc1.weight"  # 1 MiB, the tiny model's largest tensor
    overwrite_tensor_bytes(path, tiny_state_dict[name], np.random.default_rng(0).bytes(64 << 10))
    with pytest.raises(CheckpointError) as error:
        load_model(path, config=TINY)
    message = str(error.value)
    assert message.startswith(f"{path}: 1 of {len(tiny_state_dict)} tensors hold NaN, infinite or impossibly large")
    assert f"{name} (NaN)" in message
    assert f"Delete {path.resolve()} and fetch it again" in message and HF_REPO_URL in message


def test_text_over_the_data_is_refused_although_every_value_is_finite(tmp_path, tiny_pt, tiny_state_dict):
    # ASCII read as float32 is finite (exponent bits from a printable byte) but mostly far beyond any weight
    name = "aggregator.frame_blocks.0.attn.qkv.weight"
    text = b"<html><body>502 Bad Gateway</body></html>" * 100
    assert np.isfinite(np.frombuffer(text, dtype=np.float32)).all()
    overwrite_tensor_bytes(tiny_pt, tiny_state_dict[name], text)
    with pytest.raises(CheckpointError, match=rf"{name} \(values from -?[0-9.e+-]+ to [0-9.e+]+\)"):
        load_model(tiny_pt, config=TINY)


@pytest.mark.parametrize(("value", "loads"), [(65504.0, True), (-65504.0, True), (65600.0, False),
                                                (float("-inf"), False), (float("nan"), False)])
def test_weight_bound_is_the_float16_range(tmp_path, tiny_state_dict, value, loads):
    edited = dict(tiny_state_dict)
    edited["aggregator.scale_token"] = edited["aggregator.scale_token"].clone()
    edited["aggregator.scale_token"][0, 0, 0, 3] = value
    path = tmp_path / "edited.pt"
    torch.save(edited, path)
    if loads:
        assert load_model(path, config=TINY).aggregator.scale_token[0, 0, 0, 3] == value
    else:
        with pytest.raises(CheckpointError, match=r": 1 of \d+ tensors .*aggregator\.scale_token \("):
            load_model(path, config=TINY)


def test_weight_check_names_every_bad_tensor_and_skips_empty_ones():
    tensors = {"a": torch.tensor([1.0, float("inf")]), "b": torch.zeros(0), "c": torch.ones(3, dtype=torch.bfloat16),
               "d": torch.tensor([float("nan"), 2.0], dtype=torch.float16), "e": torch.tensor([-1e30, 0.5])}
    with pytest.raises(CheckpointError) as error:
        ckpt.check_weight_values(tensors, source="x.pt")
    assert str(error.value).startswith("x.pt: 3 of 4 tensors hold NaN, infinite or impossibly large values")
    assert "a (values from 1 to inf), d (NaN), e (values from -1e+30 to 0.5)" in str(error.value)
    ckpt.check_weight_values({"c": tensors["c"], "b": tensors["b"]}, source="x.pt")


# -- partial loads -------------------------------------------------------------------------------------

def test_allow_partial_loads_what_fits_and_reports_the_rest(tmp_path, tiny_model, tiny_state_dict):
    partial = dict(tiny_state_dict)
    dropped = partial.pop("camera_head.pose_branch.fc2.bias")
    partial["aggregator.scale_token"] = torch.zeros(3)
    partial["point_head.weight"] = torch.ones(4, 2)
    report = check_state_dict(tiny_model, partial, allow_partial=True)
    assert not report.is_complete
    assert report.missing == (("camera_head.pose_branch.fc2.bias", tuple(dropped.shape)),)
    assert report.unexpected == (("point_head.weight", (4, 2)),)
    assert report.mismatched == (("aggregator.scale_token", (3,), (1, 2, 1, TINY.embed_dim)),)
    assert len(report.loaded) == len(tiny_state_dict) - 2

    path = tmp_path / "partial.pt"
    torch.save(partial, path)
    with pytest.warns(UserWarning, match="partial checkpoint load") as caught:
        model = load_model(path, config=TINY, allow_partial=True)
    assert "point_head.weight [4, 2]" in str(caught[0].message)
    assert_ready_for_inference(model)
    loaded = model.state_dict()
    for name in report.loaded:
        assert torch.equal(loaded[name], tiny_state_dict[name])
    assert loaded["aggregator.scale_token"].shape == (1, 2, 1, TINY.embed_dim)  # the model's own init
    assert all(torch.isfinite(tensor).all() for tensor in loaded.values())
    with pytest.warns(UserWarning):
        again = load_model(path, config=TINY, allow_partial=True)
    assert torch.equal(again.state_dict()["camera_head.pose_branch.fc2.bias"],
                       loaded["camera_head.pose_branch.fc2.bias"])  # the filled-in init is seeded
    assert len(stream_outputs(model)) == 4


# -- the full-size model ---------------------------------------------------------------------------------

def test_full_size_state_dict_matches_the_official_manifest():
    rows = [line.split("\t") for line in GOLDEN_KEYS.read_text().splitlines() if line]
    assert len(rows) == 1342
    with torch.device("meta"):
        model = GCTStream(ModelConfig())
    # Names, shapes and dtypes must be the official ones; the order of names does not matter to loading.
    ours = {name: ("x".join(map(str, t.shape)), str(t.dtype).removeprefix("torch."))
            for name, t in model.state_dict().items()}
    assert ours == {name: (shape, dtype) for name, shape, dtype in rows}
    assert list(model.buffers()) == []  # why meta + assign=True loads everything

    official = {name: torch.empty([int(s) for s in shape.split("x")], device="meta") for name, shape, _ in rows}
    report = check_state_dict(model, official)
    assert report.is_complete and len(report.loaded) == 1342
    official["depth_head.projects.0.weight"] = torch.empty(256, 2048, 1, device="meta")
    with pytest.raises(CheckpointError, match=r"depth_head.projects.0.weight: \[256, 2048, 1\] -> \[256, 2048, 1, 1\]"):
        check_state_dict(model, official)


def test_a_tensor_left_on_meta_is_an_internal_error_not_a_silent_model():
    with torch.device("meta"):
        model = GCTStream(TINY)
    with pytest.raises(RuntimeError, match=r"left on the meta device.*aggregator\.camera_token"):
        ckpt._check_materialized(model)


# -- resolving names ---------------------------------------------------------------------------------------

def test_existing_path_is_returned_as_is(tiny_pt):
    assert resolve_checkpoint(tiny_pt) == tiny_pt
    assert resolve_checkpoint(str(tiny_pt)) == tiny_pt


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_known_name_resolves_through_the_hugging_face_cache(tmp_path, monkeypatch, tiny_pt, reference_outputs,
                                                            variable):
    monkeypatch.delenv("HF_HUB_CACHE")
    root = tmp_path / "hf-elsewhere"
    monkeypatch.setenv(variable, str(root))
    hub = root if variable == "HF_HUB_CACHE" else root / "hub"
    snapshot = make_hub_cache(hub, "lingbot-map-long.pt", tiny_pt)
    assert resolve_checkpoint("lingbot-map-long") == snapshot
    with pytest.raises(CheckpointError, match="'lingbot-map' is not on this machine"):
        resolve_checkpoint("lingbot-map")  # same repo, other file: not cached
    assert_same_outputs(stream_outputs(load_model("lingbot-map-long", config=TINY)), reference_outputs)


def test_own_checkpoint_folder_is_searched_first_and_prefers_a_converted_copy(tmp_path, tiny_pt):
    own = tmp_path / "own-checkpoints"
    own.mkdir()
    make_hub_cache(tmp_path / "hf-hub", "lingbot-map.pt", tiny_pt)
    official = own / "lingbot-map.pt"
    official.write_bytes(tiny_pt.read_bytes())
    assert resolve_checkpoint("lingbot-map") == official
    converted = convert_to_safetensors(official, own / "lingbot-map.safetensors", config=TINY)
    assert resolve_checkpoint("lingbot-map") == converted
    assert load_model("lingbot-map").config == TINY


def assert_says_how_to_fetch_by_hand(message: str, tmp_path: Path, name: str = "lingbot-map-long") -> None:
    """The file's URL for another machine and the folder to put it in here; never the download command,
    which cannot work without the hub."""
    assert f"{HF_REPO_URL}/resolve/main/{KNOWN_CHECKPOINTS[name]}" in message
    assert f"put it in {tmp_path / 'own-checkpoints'}/" in message
    assert "stream-recon download" not in message and "huggingface-cli" not in message


def test_offline_and_not_cached_says_where_to_put_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError) as error:
        load_model("lingbot-map-long")
    message = str(error.value)
    assert message.startswith("checkpoint 'lingbot-map-long' is not on this machine (looked in "
                              f"{tmp_path / 'own-checkpoints'} and in the Hugging Face cache {tmp_path / 'hf-hub'})")
    assert "offline mode is on (HF_HUB_OFFLINE)" in message
    assert_says_how_to_fetch_by_hand(message, tmp_path)


def test_not_cached_and_online_names_the_download_command(tmp_path):
    with pytest.raises(CheckpointError) as error:
        resolve_checkpoint("lingbot-map")  # resolving never downloads; nothing has failed yet
    message = str(error.value)
    assert "stream-recon download lingbot-map" in message
    assert f"{HF_REPO_URL}/resolve/main/lingbot-map.pt" in message and str(tmp_path / "own-checkpoints") in message


def test_unknown_names_list_the_known_ones(tmp_path):
    with pytest.raises(CheckpointError, match="unknown checkpoint 'lingbot-mapp'.*lingbot-map-long, lingbot-map"):
        resolve_checkpoint("lingbot-mapp")
    with pytest.raises(CheckpointError, match="checkpoint file not found"):
        resolve_checkpoint(tmp_path / "lingbot-map-long.pt")  # a path, not the name
    with pytest.raises(CheckpointError, match="unknown checkpoint name 'big'; known: lingbot-map-long, lingbot-map"):
        download_checkpoint("big")


# -- downloading (only the remote call is mocked) --------------------------------------------------------

def test_download_fills_the_hub_cache_where_resolve_finds_it(tmp_path, monkeypatch, tiny_pt):
    calls = []

    def fake_hf_hub_download(repo_id, filename, *, cache_dir, endpoint):
        calls.append((repo_id, filename, Path(cache_dir), endpoint))
        return str(make_hub_cache(Path(cache_dir), filename, tiny_pt))

    probed = []
    monkeypatch.setattr(hub_paths, "get_hf_file_metadata", lambda url, timeout: probed.append(url))
    monkeypatch.setattr(hub_paths, "hf_hub_download", fake_hf_hub_download)
    path = download_checkpoint("lingbot-map")
    assert calls == [(HF_REPO_ID, KNOWN_CHECKPOINTS["lingbot-map"], tmp_path / "hf-hub", "https://huggingface.co")]
    assert probed == [f"{HF_REPO_URL}/resolve/main/lingbot-map.pt"]
    assert resolve_checkpoint("lingbot-map") == path
    assert path.read_bytes() == tiny_pt.read_bytes()


def test_download_with_the_hub_refusing_connections_fails_at_once(tmp_path, monkeypatch):
    # At once, not after huggingface_hub's 25-30 s of retries, and without suggesting the command that failed
    endpoint = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    start = time.monotonic()
    with pytest.raises(CheckpointError) as error:
        download_checkpoint("lingbot-map-long")
    assert time.monotonic() - start < 10
    message = str(error.value)
    assert message.startswith(f"cannot download 'lingbot-map-long': the Hugging Face hub at {endpoint} cannot be "
                              "reached (")
    assert_says_how_to_fetch_by_hand(message, tmp_path)


def test_download_offline_touches_no_network_and_says_where_to_put_the_file(tmp_path, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("offline mode must not try the network")

    monkeypatch.setattr(hub_paths, "hf_hub_download", must_not_run)
    monkeypatch.setattr(hub_paths, "get_hf_file_metadata", must_not_run)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(CheckpointError, match="offline mode is on") as error:
        download_checkpoint("lingbot-map")
    assert_says_how_to_fetch_by_hand(str(error.value), tmp_path, "lingbot-map")


def test_download_failing_after_the_hub_answered_says_where_to_put_the_file(tmp_path, monkeypatch):
    def lost_connection(repo_id, filename, *, cache_dir, endpoint):
        raise LocalEntryNotFoundError("connection lost and no cached copy")

    monkeypatch.setattr(hub_paths, "get_hf_file_metadata", lambda url, timeout: None)
    monkeypatch.setattr(hub_paths, "hf_hub_download", lost_connection)
    with pytest.raises(CheckpointError, match="cannot be reached") as error:
        download_checkpoint("lingbot-map-long")
    assert_says_how_to_fetch_by_hand(str(error.value), tmp_path)
