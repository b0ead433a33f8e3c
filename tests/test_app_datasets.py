"""Sequence discovery and TUM frame lists on real files."""

import cv2
import numpy as np
import pytest
from dataset_tree import (
    TUM_START,
    write_broken_video,
    write_dataset_tree,
    write_image_folder,
    write_tum_sequence,
    write_video,
)

from stream_recon.app.evaluation.datasets import DatasetError, TumFrames, discover_sequences
from stream_recon.app.sources.frames import SourceError


def test_tree_is_discovered_in_order_with_ground_truth(tmp_path):
    root = write_dataset_tree(tmp_path / "data", frames=3)
    sequences = discover_sequences(root)
    assert [(s.name, s.kind) for s in sequences] == [
        ("images_frames_a", "images"),
        ("tum_rgbd_dataset_synth", "tum"),
        ("videos_clip", "video"),
        ("videos_zz_broken", "video"),
    ]
    tum = sequences[1]
    assert tum.gt_file == root / "tum" / "rgbd_dataset_synth" / "groundtruth.txt"
    assert tum.depth_dir == root / "tum" / "rgbd_dataset_synth"
    assert all(s.gt_file is None for s in sequences if s.kind != "tum")
    assert discover_sequences(root) == sequences


def test_output_inside_root_depth_folders_and_hidden_entries_are_skipped(tmp_path):
    root = tmp_path / "data"
    write_video(root / "a.mp4", 2)
    write_image_folder(root / "out" / "a" / "frames", 2)  # looks like a sequence, but is the batch output
    write_image_folder(root / "scene" / "depth", 2)
    write_image_folder(root / ".cache", 2)
    assert [s.name for s in discover_sequences(root, exclude=(root / "out",))] == ["a"]


def test_clashing_names_get_suffixes(tmp_path):
    root = tmp_path / "data"
    write_video(root / "v" / "a.mp4", 2)
    write_video(root / "v" / "a.avi", 2)
    write_image_folder(root / "v_a", 2)
    assert [(s.name, s.source.name) for s in discover_sequences(root)] == [
        ("v_a", "a.avi"),
        ("v_a-2", "a.mp4"),
        ("v_a-3", "v_a"),
    ]


def test_root_that_is_one_sequence(tmp_path):
    folder = write_tum_sequence(tmp_path / "rgbd_dataset_freiburg1_xyz", 2)
    [sequence] = discover_sequences(folder)
    assert (sequence.name, sequence.kind, sequence.source) == ("rgbd_dataset_freiburg1_xyz", "tum", folder)
    [video] = discover_sequences(write_video(tmp_path / "walk.mp4", 2))
    assert (video.name, video.kind) == ("walk", "video")


def test_manifest_lists_paths_with_optional_names(tmp_path):
    root = tmp_path / "data"
    write_video(root / "videos" / "one.mp4", 2)
    write_image_folder(root / "my frames", 2)
    write_tum_sequence(root / "tum" / "seq", 2)
    write_video(root / "not_listed.mp4", 2)
    (root / "sequences.txt").write_text(
        "# path [name]\nvideos/one.mp4 first\n\nmy frames\ntum/seq  videos_one\n"
    )
    sequences = discover_sequences(root)
    assert [(s.name, s.kind) for s in sequences] == [
        ("first", "video"),
        ("my_frames", "images"),
        ("videos_one", "tum"),
    ]


def test_manifest_errors_name_the_line(tmp_path):
    root = tmp_path / "data"
    write_video(root / "one.mp4", 2)
    (root / "sequences.txt").write_text("one.mp4 a\nmissing.mp4\n")
    with pytest.raises(DatasetError, match=r"sequences.txt, line 2: .*missing.mp4 does not exist"):
        discover_sequences(root)
    (root / "sequences.txt").write_text("one.mp4 a\none.mp4 a\n")
    with pytest.raises(DatasetError, match=r"line 2: name 'a' is already used on line 1"):
        discover_sequences(root)
    (root / "empty").mkdir()
    (root / "sequences.txt").write_text("empty\n")
    with pytest.raises(DatasetError, match="line 1: .*folder without images"):
        discover_sequences(root)


def test_nothing_to_do_is_an_error(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(DatasetError, match="no sequences found under"):
        discover_sequences(tmp_path / "empty")
    with pytest.raises(DatasetError, match="does not exist"):
        discover_sequences(tmp_path / "nowhere")


def test_tum_frames_are_rgb_with_rgb_txt_timestamps(tmp_path):
    folder = write_tum_sequence(tmp_path / "seq", 3)
    frames = TumFrames(folder)
    assert len(frames) == 3
    delivered = list(frames)
    assert [timestamp for _, timestamp in delivered] == pytest.approx(
        TUM_START + np.arange(3) / 30.0, abs=1e-6
    )
    first_png = cv2.imread(str(sorted((folder / "rgb").iterdir())[0]))
    np.testing.assert_array_equal(delivered[0][0], first_png[..., ::-1])
    assert delivered[0][0].dtype == np.uint8 and delivered[0][0].shape == (48, 64, 3)
    assert len(list(frames)) == 3  # iterable again


def test_tum_frames_report_missing_and_broken_files(tmp_path):
    folder = write_tum_sequence(tmp_path / "seq", 3)
    victim = sorted((folder / "rgb").iterdir())[1]
    victim.unlink()
    with pytest.raises(DatasetError, match=r"lists 1 frame\(s\) that do not exist"):
        TumFrames(folder)
    write_broken_video(victim)  # garbage bytes under a .png name
    with pytest.raises(SourceError, match="is not a readable image"):
        list(TumFrames(folder))
    (folder / "rgb.txt").write_text("1.0 rgb/a.png\nnot-a-time rgb/b.png\n")
    with pytest.raises(DatasetError, match="rgb.txt, line 2: expected 'timestamp filename'"):
        TumFrames(folder)
