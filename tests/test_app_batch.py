"""`batch` on a real dataset tree with the tiny model: summary, failures, resume, kill and rerun, Ray."""

import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_tiny_model
from dataset_tree import write_dataset_tree, write_image_folder, write_tum_sequence

from stream_recon.app.evaluation.batch import COMPLETE_MARKER, BatchError, plan_actors, run_batch
from stream_recon.app.evaluation.batch_resume import finished_row, finished_settings
from stream_recon.app.evaluation.batch_summary import SUMMARY_COLUMNS, SUMMARY_JSON, write_summary
from stream_recon.app.evaluation.datasets import discover_sequences
from stream_recon.app.options import RunOptions, changed_settings
from stream_recon.app.outputs.json_records import exact_strings, write_json_atomic
from stream_recon.app.outputs.rundir import TRAJECTORY_OPEN_TUM, TRAJECTORY_TUM
from stream_recon.app.outputs.trajectories import read_tum, write_tum
from stream_recon.models import ModelConfig

FRAMES = 6
# 64 x 48 frames -> 56 x 42 model input: the tiny model runs each frame in milliseconds on CPU.
OPTIONS = RunOptions(device="cpu", image_width=56, scale_frames=4, viewer=False)
TESTS_DIR = Path(__file__).parent


def read_summary(output_dir: Path) -> list[dict]:
    """The batch's summary.json rows, each string as the batch read it (exact_strings: a name that is not
    UTF-8 comes back exactly)."""
    return [exact_strings(row) for row in json.loads((Path(output_dir) / SUMMARY_JSON).read_text(encoding="utf-8"))]


def load_missing_model():
    raise ValueError("checkpoint /nowhere/model.safetensors does not exist")


# Ray workers run torch on one thread; the in-process runs do the same (conftest.py's one_torch_thread), so
# results compare exactly.


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return write_dataset_tree(tmp_path_factory.mktemp("data"), frames=FRAMES)


@pytest.fixture(scope="module")
def serial_run(dataset, tmp_path_factory):
    output = tmp_path_factory.mktemp("serial")
    rows = run_batch(discover_sequences(dataset), output, OPTIONS, load_model=build_tiny_model)
    return output, rows


def comparable(row):
    """A row without the fields that measure time."""
    return {key: value for key, value in row.items() if key not in ("fps", "seconds", "status")}


def test_summary_has_every_sequence_and_the_broken_one_with_its_error(serial_run):
    output, rows = serial_run
    assert read_summary(output) == rows
    assert [(row["name"], row["status"]) for row in rows] == [
        ("images_frames_a", "ok"),
        ("tum_rgbd_dataset_synth", "ok"),
        ("videos_clip", "ok"),
        ("videos_zz_broken", "failed"),
    ]
    broken = rows[3]
    # the sentence the CLI gives for it, without the class name it was raised as
    assert "zz_broken.mp4" in broken["error"] and "SourceError" not in broken["error"]
    assert broken["frames"] is None and not (output / "videos_zz_broken" / COMPLETE_MARKER).exists()
    for row in rows[:3]:
        assert row["frames"] == FRAMES and row["error"] is None and row["fps"] > 0
        run_dir = output / row["name"]
        assert json.loads((run_dir / "run.json").read_text())["status"] == "complete"
        assert len(list((run_dir / "predictions").glob("*.npz"))) == FRAMES
        assert finished_row(run_dir) == row
        assert finished_settings(run_dir) == OPTIONS.result_settings()


def test_tum_sequence_is_evaluated_against_its_ground_truth(serial_run):
    output, rows = serial_run
    tum = rows[1]
    evaluation = json.loads((output / "tum_rgbd_dataset_synth" / "eval.json").read_text())
    assert tum["matched_poses"] == FRAMES == evaluation["matched_poses"]
    for key in (
        "alignment",
        "scale",
        "ate_rmse",
        "rpe_trans_rmse",
        "rpe_rot_rmse_deg",
        "auc_30",
        "depth_abs_rel",
    ):
        assert tum[key] == evaluation[key]
    assert evaluation["depth_frames"] == FRAMES and 0 <= tum["depth_delta1"] <= 1
    assert all("ate_rmse" not in row for row in rows if row["kind"] != "tum")


def test_summary_csv_has_the_same_rows_and_every_column(serial_run):
    output, rows = serial_run
    with (output / "summary.csv").open() as file:
        table = list(csv.DictReader(file))
    assert list(table[0]) == list(SUMMARY_COLUMNS)
    assert [line["name"] for line in table] == [row["name"] for row in rows]
    assert float(table[1]["ate_rmse"]) == rows[1]["ate_rmse"]
    assert table[0]["ate_rmse"] == "" and table[3]["frames"] == ""
    assert table[3]["status"] == "failed" and table[3]["error"] == rows[3]["error"]


def test_a_sequence_name_that_is_not_utf8_leaves_both_summaries_strict_utf8(tmp_path):
    """A folder named on another system reaches Python with lone surrogates: summary.json and summary.csv still
    decode as strict UTF-8 (the name readable, its byte as \\xff), and read_summary gives the exact name back."""
    name = os.fsdecode(b"walk_\xff")
    rows = [{"name": name, "source": f"/data/{name}", "kind": "images", "status": "ok", "error": None}]
    write_summary(tmp_path, rows)
    text = (tmp_path / "summary.json").read_bytes().decode("utf-8")  # strict: raises on a lone surrogate
    assert "walk_\\\\xff" in text
    table = (tmp_path / "summary.csv").read_bytes().decode("utf-8")
    assert "walk_\\xff" in table
    [row] = read_summary(tmp_path)
    assert row["name"] == name and row["source"] == f"/data/{name}"


def test_second_invocation_skips_finished_sequences(serial_run, dataset):
    output, first_rows = serial_run
    stamps = {row["name"]: (output / row["name"] / "run.json").stat().st_mtime_ns for row in first_rows[:3]}
    rows = run_batch(discover_sequences(dataset), output, OPTIONS, load_model=build_tiny_model)
    assert [row["status"] for row in rows] == ["skipped", "skipped", "skipped", "failed"]
    for before, after in zip(first_rows[:3], rows[:3], strict=True):
        assert comparable(before) == comparable(after)
        assert (output / after["name"] / "run.json").stat().st_mtime_ns == stamps[after["name"]]
    assert read_summary(output) == rows


def test_partial_run_directory_is_redone_from_scratch(serial_run, dataset, tmp_path):
    sequences = [s for s in discover_sequences(dataset) if s.kind == "images"]
    partial = tmp_path / sequences[0].name
    (partial / "predictions").mkdir(parents=True)
    (partial / "predictions" / "000099.npz").write_bytes(b"left over from a killed run")
    [row] = run_batch(sequences, tmp_path, OPTIONS, load_model=build_tiny_model)
    assert row["status"] == "ok" and row["frames"] == FRAMES
    assert not (partial / "predictions" / "000099.npz").exists()
    assert comparable(row) == comparable(serial_run[1][0])


def test_rerun_with_other_settings_is_refused_before_the_model_loads(tmp_path):
    # A rerun with --image-width or --scale-frames changed must be refused, not report every sequence
    # "skipped" and keep the old results
    root = tmp_path / "data"
    write_image_folder(root / "a", FRAMES)
    write_image_folder(root / "b", FRAMES)
    output = tmp_path / "out"
    run_batch(discover_sequences(root), output, OPTIONS, load_model=build_tiny_model)
    before = {name: (output / name / "run.json").read_bytes() for name in ("a", "b")}
    wider = dataclasses.replace(OPTIONS, image_width=70, scale_frames=3)

    # a loader that fails: the refusal must come before any model would load
    with pytest.raises(BatchError) as refused:
        run_batch(discover_sequences(root), output, wider, load_model=load_missing_model)

    assert str(refused.value) == (
        f"2 of 2 sequences in {output} were finished with other settings (a, b: scale_frames 4 -> 3, "
        "image_width 56 -> 70); pass --overwrite to redo them with these settings, or choose another --output"
    )
    assert {name: (output / name / "run.json").read_bytes() for name in ("a", "b")} == before


def test_overwrite_redoes_only_the_sequences_finished_with_other_settings(tmp_path):
    root = tmp_path / "data"
    write_image_folder(root / "a", FRAMES)
    write_image_folder(root / "b", FRAMES)
    output = tmp_path / "out"
    wider = dataclasses.replace(OPTIONS, image_width=70)
    run_batch(discover_sequences(root)[:1], output, OPTIONS, load_model=build_tiny_model)  # a: old settings
    run_batch(discover_sequences(root)[1:], output, wider, load_model=build_tiny_model)  # b: the new ones
    (output / "a" / "eval.json").write_text("{}")  # derived from the old run: goes with it

    rows = run_batch(discover_sequences(root), output, wider, load_model=build_tiny_model, overwrite=True)

    assert [(row["name"], row["status"]) for row in rows] == [("a", "ok"), ("b", "skipped")]
    with np.load(output / "a" / "predictions" / "000000.npz") as frame:
        assert frame["depth"].shape[1] == 70  # redone at the new width
    assert not (output / "a" / "eval.json").exists()
    assert finished_settings(output / "a") == wider.result_settings()
    again = run_batch(discover_sequences(root), output, wider, load_model=load_missing_model)
    assert [row["status"] for row in again] == ["skipped", "skipped"]


def test_batch_command_names_the_flag_when_settings_changed(tmp_path):
    from typer.testing import CliRunner

    from stream_recon.app.cli import app

    root = tmp_path / "data"
    write_image_folder(root / "a", FRAMES)
    output = tmp_path / "out"
    run_batch(discover_sequences(root), output, OPTIONS, load_model=build_tiny_model)
    # the checkpoint does not exist: the settings are compared before it would be loaded
    arguments = ["batch", str(root), "-o", str(output), "--device", "cpu", "--image-width", "42", "--scale-frames",
                 "4", "--checkpoint", str(tmp_path / "none.safetensors")]

    result = CliRunner().invoke(app, arguments)

    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: 1 of 1 sequences in ") and len(result.output.strip().splitlines()) == 1
    assert "checkpoint None -> " in result.output and "image_width 56 -> 42" in result.output
    assert "pass --overwrite to redo them" in result.output


KILLABLE_BATCH = textwrap.dedent(
    """
    import sys, torch
    torch.set_num_threads(1)
    sys.path.insert(0, {tests_dir!r})
    from conftest import build_tiny_model
    from test_app_batch import OPTIONS
    from stream_recon.app.evaluation.batch import BatchInterrupted, run_batch
    from stream_recon.app.evaluation.datasets import discover_sequences
    try:
        run_batch(discover_sequences({root!r}), {output!r}, OPTIONS, load_model=build_tiny_model)
    except BatchInterrupted:
        sys.exit(130)
    """
)


def start_batch_and_wait_for(root, output, sequence_name):
    """Start a batch in a child process; return it once `sequence_name` has written a prediction."""
    script = KILLABLE_BATCH.format(tests_dir=str(TESTS_DIR), root=str(root), output=str(output))
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    predictions = output / sequence_name / "predictions"
    deadline = time.monotonic() + 60
    while not (predictions.is_dir() and any(predictions.glob("*.npz"))):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the batch never reached {sequence_name}: {process.stderr.read().decode()}")
        time.sleep(0.01)
    return process


@pytest.mark.slow  # two batch processes
def test_batch_killed_mid_sequence_completes_when_rerun(tmp_path):
    root = tmp_path / "data"
    write_image_folder(root / "a_short", FRAMES)
    write_image_folder(root / "b_long", 120)
    output = tmp_path / "out"
    long_predictions = output / "b_long" / "predictions"
    process = start_batch_and_wait_for(root, output, "b_long")
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL
    assert not (output / "b_long" / COMPLETE_MARKER).exists()
    assert [row["name"] for row in read_summary(output)] == ["a_short"]  # what finished was recorded

    rows = run_batch(discover_sequences(root), output, OPTIONS, load_model=build_tiny_model)
    assert [(row["name"], row["status"], row["frames"]) for row in rows] == [
        ("a_short", "skipped", FRAMES),
        ("b_long", "ok", 120),
    ]
    assert len(list(long_predictions.glob("*.npz"))) == 120
    assert json.loads((output / "b_long" / "run.json").read_text())["status"] == "complete"


@pytest.mark.slow
def test_ctrl_c_stops_the_batch_after_saving_the_current_sequence(tmp_path):
    root = tmp_path / "data"
    write_image_folder(root / "a_long", 120)
    write_image_folder(root / "b_next", FRAMES)
    output = tmp_path / "out"
    process = start_batch_and_wait_for(root, output, "a_long")
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 130, process.stderr.read().decode()
    [row] = read_summary(output)
    # it was listed as `failed`: stopped is not failed
    assert (row["name"], row["status"]) == ("a_long", "interrupted")
    assert row["error"].startswith("stopped by a signal") and 0 < row["frames"] < 120
    assert json.loads((output / "a_long" / "run.json").read_text())["status"] == "interrupted"
    assert not (output / "b_next").exists()  # the batch stopped instead of going on


@pytest.mark.slow  # starts a Ray instance: tens of seconds on a busy machine
def test_ray_batch_gives_the_serial_results(serial_run, dataset, tmp_path):
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    serial_output, serial_rows = serial_run
    # Workers import build_tiny_model from tests/conftest.py, as a real cluster imports the user's loader.
    python_path = os.pathsep.join([str(TESTS_DIR), *sys.path])
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        logging_level="ERROR",
        runtime_env={"env_vars": {"PYTHONPATH": python_path}},
    )
    try:
        rows = run_batch(
            discover_sequences(dataset),
            tmp_path,
            OPTIONS,
            load_model=build_tiny_model,
            ray_address="auto",
            gpus_per_task=0,
        )
        # Workers that cannot even load the model fail every sequence by name instead of hanging the batch.
        dead_rows = run_batch(
            discover_sequences(dataset),
            tmp_path / "dead",
            OPTIONS,
            load_model=load_missing_model,
            ray_address="auto",
            gpus_per_task=0,
        )
    finally:
        ray.shutdown()
    assert [row["status"] for row in dead_rows] == ["failed"] * 4
    for row in dead_rows:
        assert row["error"].startswith("Ray worker failed: ")
        assert "checkpoint /nowhere/model.safetensors does not exist" in row["error"]
        assert "\x1b[" not in row["error"]
    assert [row["status"] for row in rows] == ["ok", "ok", "ok", "failed"]
    assert read_summary(tmp_path) == rows
    for serial, distributed in zip(serial_rows, rows, strict=True):
        assert comparable(distributed).keys() == comparable(serial).keys()
        for key, value in comparable(serial).items():
            if isinstance(value, float):
                assert distributed[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (serial["name"], key)
            else:
                assert distributed[key] == value, (serial["name"], key)
        if serial["status"] == "ok":
            ours = np.loadtxt(tmp_path / serial["name"] / "trajectory_tum.txt")
            theirs = np.loadtxt(serial_output / serial["name"] / "trajectory_tum.txt")
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_ray_plan_needs_gpus_only_when_asked():
    assert plan_actors({"CPU": 2.0}, 0, sequences=5) == 2
    assert plan_actors({"CPU": 16.0, "GPU": 4.0}, 1, sequences=3) == 3
    assert plan_actors({"CPU": 16.0, "GPU": 4.0}, 0.5, sequences=20) == 8
    with pytest.raises(BatchError, match="has 0 GPU.*--gpus-per-task 0"):
        plan_actors({"CPU": 8.0}, 1, sequences=2)


def test_output_overlapping_the_dataset_is_refused(tmp_path):
    root = tmp_path / "data"
    write_image_folder(root / "scene", FRAMES)
    sequences = discover_sequences(root)
    # OUTPUT/scene would be the input folder itself, and a partial run there would be deleted.
    with pytest.raises(BatchError, match="overlaps the input"):
        run_batch(sequences, root, OPTIONS, load_model=build_tiny_model)
    with pytest.raises(BatchError, match="overlaps the input"):
        run_batch(sequences, root / "scene" / "out", OPTIONS, load_model=build_tiny_model)
    assert len(list((root / "scene").glob("*.png"))) == FRAMES


def test_a_foreign_folder_in_the_way_is_never_deleted(tmp_path, dataset):
    sequences = [s for s in discover_sequences(dataset) if s.kind == "images"]
    foreign = tmp_path / sequences[0].name
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone's work")
    [row] = run_batch(sequences, tmp_path, OPTIONS, load_model=build_tiny_model)
    assert row["status"] == "failed" and "is not a stream-recon run directory" in row["error"]
    assert (foreign / "notes.txt").read_text() == "someone's work"


def test_output_that_is_a_file_is_refused(tmp_path, dataset):
    (tmp_path / "out").write_text("not a folder")
    with pytest.raises(BatchError, match="exists and is not a folder"):
        run_batch(discover_sequences(dataset), tmp_path / "out", OPTIONS, load_model=build_tiny_model)


def test_batch_command_rejects_bad_input_with_one_sentence(tmp_path):
    from typer.testing import CliRunner

    from stream_recon.app.cli import app

    runner = CliRunner()
    missing = runner.invoke(app, ["batch", str(tmp_path / "nowhere"), "--output", str(tmp_path / "out")])
    assert missing.exit_code == 2
    assert "does not exist" in " ".join(missing.output.split()) and "Traceback" not in missing.output
    alignment = runner.invoke(
        app, ["batch", str(tmp_path), "-o", str(tmp_path / "out"), "--alignment", "sim2"]
    )
    assert alignment.exit_code == 2 and "--alignment must be sim3 or se3" in alignment.output
    # run options reach RunOptions through the same flags as `run`
    window = runner.invoke(app, ["batch", str(tmp_path), "-o", str(tmp_path / "out"), "--chunk-frames", "4"])
    assert window.exit_code == 2 and "--chunk-frames (4) must be more than --scale-frames (8)" in window.output


def test_batch_command_reports_a_missing_checkpoint_before_any_sequence(tmp_path, dataset):
    from typer.testing import CliRunner

    from stream_recon.app.cli import app

    output = tmp_path / "out"
    arguments = ["batch", str(dataset), "-o", str(output), "--device", "cpu", "--checkpoint", str(tmp_path / "x.pt")]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 2, result.output
    assert "x.pt" in " ".join(result.output.split()) and "Traceback" not in result.output
    assert not output.exists()  # refused before anything was written: no empty summary is left


def test_batch_command_end_to_end_matches_the_library(tmp_path, dataset, serial_run):
    from typer.testing import CliRunner

    from stream_recon.app.cli import app
    from stream_recon.models.checkpoint import convert_to_safetensors

    # The same weights as build_tiny_model, shipped the way users ship them: a .safetensors with its config.
    torch.save(build_tiny_model().state_dict(), tmp_path / "tiny.pt")
    checkpoint = convert_to_safetensors(
        tmp_path / "tiny.pt", tmp_path / "tiny.safetensors", ModelConfig.tiny()
    )
    output = tmp_path / "out"
    arguments = ["batch", str(dataset), "-o", str(output), "--checkpoint", str(checkpoint), "--device", "cpu",
                 "--image-width", "56", "--scale-frames", "4"]
    result = CliRunner().invoke(app, arguments)
    assert result.exit_code == 1, result.output  # one sequence failed; the others are done
    text = " ".join(result.output.split())
    assert "summary.json" in text and "videos_zz_broken" in text
    rows = read_summary(output)
    assert [comparable(row) for row in rows] == [comparable(row) for row in serial_run[1]]
    again = CliRunner().invoke(app, arguments)
    assert [row["status"] for row in read_summary(output)] == ["skipped", "skipped", "skipped", "failed"]
    assert again.exit_code == 1


def test_the_same_checkpoint_by_another_path_is_not_other_settings(tmp_path, monkeypatch):
    # --checkpoint /abs/rule.pt, then from another folder --checkpoint rel/rule.pt: refused as "other settings"
    from typer.testing import CliRunner

    from stream_recon.app.cli import app
    from stream_recon.models.checkpoint import convert_to_safetensors

    models = tmp_path / "models"
    models.mkdir()
    torch.save(build_tiny_model().state_dict(), models / "tiny.pt")
    checkpoint = convert_to_safetensors(models / "tiny.pt", models / "tiny.safetensors", ModelConfig.tiny())
    root, output = write_image_folder(tmp_path / "data" / "a", FRAMES).parent, tmp_path / "out"
    arguments = ["batch", str(root), "-o", str(output), "--device", "cpu", "--image-width", "56", "--scale-frames", "4"]

    first = CliRunner().invoke(app, [*arguments, "--checkpoint", str(checkpoint)])
    monkeypatch.chdir(tmp_path)
    again = CliRunner().invoke(app, [*arguments, "--checkpoint", "models/tiny.safetensors"])

    assert first.exit_code == 0 and again.exit_code == 0, (first.output, again.output)
    assert [row["status"] for row in read_summary(output)] == ["skipped"]
    other = CliRunner().invoke(app, [*arguments, "--checkpoint", "models/tiny.pt"])  # another file: a change
    assert other.exit_code == 2 and f"checkpoint {checkpoint} -> models/tiny.pt" in " ".join(other.output.split())


def with_loop_closure_outputs(run_sequence, corrected_sequence):
    """run_sequence, then, for `corrected_sequence`, the files a run that loop closure corrected leaves:
    the open chain (its trajectory with a drift that grows along it) and run.json's loop_closure summary.
    The tiny model's 6-frame streams never close a loop, so the correction's outputs are written here."""

    def run_and_correct(source, output_dir, options, **kwargs):
        summary = run_sequence(source, output_dir, options, **kwargs)
        run_dir = Path(output_dir)
        if run_dir.name == corrected_sequence:
            stamps, c2w = read_tum(run_dir / TRAJECTORY_TUM)
            c2w[:, :3, 3] += np.arange(len(c2w))[:, None] * np.array([0.3, 0.0, 0.1])
            write_tum(run_dir / TRAJECTORY_OPEN_TUM, stamps, c2w)
            info = json.loads((run_dir / "run.json").read_text())
            info["summary"]["loop_closure"] = {"mode": "on", "loops": [], "accepted": 2, "rejected": 1}
            write_json_atomic(run_dir / "run.json", info)
        return summary

    return run_and_correct


def table_rows(output, title):
    """The body rows of the rich table printed under `title`, as lists of stripped cells."""
    table = output.split(title, 1)[1]
    return [[cell.strip() for cell in line.split("│")[1:-1]] for line in table.splitlines() if "│" in line]


def test_batch_summary_shows_the_ate_with_and_without_loop_closure(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import stream_recon.app.evaluation.batch as batch_module
    from stream_recon.app.cli import app
    from stream_recon.models.checkpoint import convert_to_safetensors

    monkeypatch.setattr(batch_module, "run_sequence", with_loop_closure_outputs(batch_module.run_sequence, "a"))
    torch.save(build_tiny_model().state_dict(), tmp_path / "tiny.pt")
    checkpoint = convert_to_safetensors(tmp_path / "tiny.pt", tmp_path / "tiny.safetensors", ModelConfig.tiny())
    root, output = tmp_path / "data", tmp_path / "out"
    write_tum_sequence(root / "a", FRAMES)
    write_tum_sequence(root / "b", FRAMES)
    arguments = ["batch", str(root), "-o", str(output), "--checkpoint", str(checkpoint), "--device", "cpu",
                 "--image-width", "56", "--scale-frames", "4"]

    first = CliRunner().invoke(app, arguments, env={"COLUMNS": "200"})
    again = CliRunner().invoke(app, arguments, env={"COLUMNS": "200"})  # skipped: the rows from the markers

    assert first.exit_code == 0 and again.exit_code == 0, (first.output, again.output)
    evaluation = {name: json.loads((output / name / "eval.json").read_text()) for name in ("a", "b")}
    corrected, open_chain = evaluation["a"]["ate_rmse"], evaluation["a"]["open_chain"]["ate_rmse"]
    assert "open_chain" not in evaluation["b"]
    # b's run.json reports loop closure only once runs do; its row says what run.json says
    b_loops = json.loads((output / "b" / "run.json").read_text())["summary"].get("loop_closure", {}).get("accepted")
    rows = read_summary(output)
    assert [(row["name"], row.get("loops_accepted"), row.get("open_chain_ate_rmse")) for row in rows] == [
        ("a", 2, open_chain), ("b", b_loops, None)]
    assert [row["ate_rmse"] for row in rows] == [corrected, evaluation["b"]["ate_rmse"]]
    with (output / "summary.csv").open() as file:
        table = list(csv.DictReader(file))
    assert float(table[0]["open_chain_ate_rmse"]) == open_chain and table[1]["open_chain_ate_rmse"] == ""
    assert table[0]["loops_accepted"] == "2" and table[1]["loops_accepted"] == ("" if b_loops is None else str(b_loops))
    for result, status in ((first, "ok"), (again, "skipped")):
        printed = table_rows(result.output, "summary.json")
        assert [row[:2] + row[4:7] for row in printed] == [
            ["a", status, "2", f"{corrected:.4f}", f"{open_chain:.4f}"],
            ["b", status, table[1]["loops_accepted"], f"{evaluation['b']['ate_rmse']:.4f}", "-"],
            ["mean of 1 with an open chain", "", "", f"{corrected:.4f}", f"{open_chain:.4f}"],
        ]


def test_loop_closure_is_a_setting_that_changes_results(tmp_path):
    from typer.testing import CliRunner

    from stream_recon.app.cli import app

    root = tmp_path / "data"
    write_image_folder(root / "a", FRAMES)
    output = tmp_path / "out"
    run_batch(discover_sequences(root), output, OPTIONS, load_model=build_tiny_model)
    assert finished_settings(output / "a")["loop_closure"] == "auto"
    arguments = ["batch", str(root), "-o", str(output), "--device", "cpu", "--image-width", "56", "--scale-frames",
                 "4", "--checkpoint", str(tmp_path / "none.safetensors"), "--loop-closure", "off"]

    result = CliRunner().invoke(app, arguments)

    assert result.exit_code == 2, result.output
    assert "loop_closure auto -> off" in result.output and "pass --overwrite to redo them" in result.output
    assert changed_settings(OPTIONS.result_settings(), dataclasses.replace(OPTIONS, loop_closure="on")
                            .result_settings()) == ["loop_closure auto -> on"]
