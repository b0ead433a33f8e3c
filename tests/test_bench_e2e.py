"""scripts/bench_e2e.py runs end to end on the CPU (its smoke test): a video made from the sample frames,
run_sequence with the live viewer and a websocket client, window rollovers, the engine alone, the JSON.

Numbers are not checked against any speed (that is for scripts, not tests), only that each was measured.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the bench's own runs: ~10 s

REPO = Path(__file__).resolve().parent.parent
REQUIRED_KEYS = ("steady_fps", "engine_fps", "p50_ms", "p99_ms", "first_prediction_s", "longest_stall_ms",
                 "bytes_per_frame", "host_rss_gb")


def run_bench(tmp_path: Path, *args: str) -> dict:
    result_file = tmp_path / "result.json"
    command = [sys.executable, str(REPO / "scripts" / "bench_e2e.py"), "--device", "cpu", "--frames", "24",
               "--image-width", "112", "--scale", "2", "--window", "4", "--video-dir", str(tmp_path),
               "--json", str(result_file), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "steady FPS: product / engine" in done.stdout  # the table
    return json.loads(result_file.read_text())


def test_tiny_model_with_viewer_client_and_rollovers(tmp_path: Path) -> None:
    log = tmp_path / "stream.log"
    result = run_bench(tmp_path, "--model", "tiny", "--viewer", "--client", "--chunk-frames", "8", "--overlap", "3",
                       "--save-predictions", "keyframes", "--no-save-images", "--log", str(log))

    for key in REQUIRED_KEYS:
        assert isinstance(result[key], (int, float)) and result[key] > 0, key
    assert result["frames"] == 24 and result["engine_frames"] == 24
    assert result["model_input"] == "112x84"
    assert result["rollovers"] >= 2 and result["re_emissions"] > 0  # frames a later window re-predicted
    assert len(result["rollover_regions"]) == result["rollovers"] and result["rollover_longest_ms"] > 0
    assert result["p99_ms"] >= result["p50_ms"] and result["longest_stall_ms"] >= result["p99_ms"]
    assert result["first_prediction_from_process_start_s"] > result["first_prediction_s"]
    assert result["client"]["error"] is None and result["client"]["bytes"] > 0  # the scene reached it
    assert result["settings"]["save_images"] is False
    # no image: depth and confidence in float16 (and the fixed fields) are all a frame costs
    assert result["bytes_per_frame"] < 2 * 2 * 112 * 84 + 4000
    # the engine's log reached the file: a line per rollover, of the product run and of the engine run after it
    assert log.read_text().count("INFO stream_recon.models.stream.chunked: chunk rollover") == 2 * result["rollovers"]


def test_stand_in_engine_measures_the_product_path_alone(tmp_path: Path) -> None:
    # without the viewer, then with it on the same --video-dir: the second run finds the first one's video
    for viewer, video_made in (("--no-viewer", True), ("--viewer", False)):
        result = run_bench(tmp_path, "--stand-in-ms", "20", viewer)

        assert result["engine"] == "stand-in, 20 ms per frame", viewer
        for key in REQUIRED_KEYS:
            assert isinstance(result[key], (int, float)) and result[key] > 0, (viewer, key)
        assert result["frames"] == result["keyframes"] == 24, viewer
        assert result["main_thread_outside_engine_ms_p50"] >= 0, viewer
        # a video made in this run: its making is not part of a user's start ("from the process's start")
        assert (result["video_made_s"] > 0) if video_made else (result["video_made_s"] == 0), viewer


def test_rollover_trace_names_each_part_of_every_rollover(tmp_path: Path) -> None:
    command = [sys.executable, str(REPO / "scripts" / "probes" / "trace_rollover.py"), "--pace", "1.5", "--memory-push", "3", "--profile-push", "9", "--device", "cpu",
               "--model", "tiny", "--frames", "20", "--image-width", "112", "--scale", "2", "--window", "4",
               "--chunk-frames", "8", "--overlap", "3", "--video-dir", str(tmp_path), "--no-engine-run",
               # every span up to 5 s after each rollover's start: its alignment comes once the shared frames
               # have streamed, 0.4 s after it here, later on a busier machine
               "--trace-after", "5"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    rollovers, _, longest = done.stdout.partition(" ms from push ")
    sections = rollovers.split("== rollover ")[1:]
    assert len(sections) >= 2  # chunks of 8 frames, 5 apart: rollovers at frames 8 and 13 (and 18)
    for section in sections:
        for part in ("rollover", "finish", "align: median", "sinks"):
            assert part in section, (part, section[:2000])
        # how many of the 3 shared frames had their ratios made before the estimate depends on how far the
        # spare got beside the stream: the machine's load, not the trace
        assert re.search(r"align: estimate \([0-3] of 3 ratios ahead\)", section), section[:2000]
    # then the 4 longest intervals between pushes, each with the pushes that bound it
    assert done.stdout.count(" ms from push ") == 4
    assert "MainThread     push" in longest and "MainThread     step" in longest
    assert "== the caching allocator's device calls from the run's start through push 3" in done.stdout  # (none on a CPU)
    assert "== push 9 under torch.profiler, its operators by CPU time" in done.stdout
    assert "aten::linear" in done.stdout.partition("under torch.profiler")[2]


def test_a_rollover_region_runs_from_the_overlap_before_it_to_past_the_provisional_frames() -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_e2e import Deliveries, interval_stats

    # Frames 0-29, one emission each 25 ms; a rollover counted at frame 20's delivery, frames 20-22 first
    # emitted provisionally (and again after 23), one slow interval at frame 24 and one far from it at 5.
    d = Deliveries()
    clock = 0.0
    for frame in range(30):
        clock += 0.060 if frame in (5, 24) else 0.025
        d.times.append(clock)
        d.frames.append(frame)
        d.chunks.append(0 if frame < 20 else 1)
        d.rollovers.append(0 if frame < 20 else 1)
        d.provisional.append(20 <= frame <= 22)
        if frame == 23:
            for again in (20, 21, 22):
                d.times.append(clock)
                d.frames.append(again)
                d.chunks.append(1)
                d.rollovers.append(1)
                d.provisional.append(False)
    stats = interval_stats(d, steady_from=0, overlap=4)
    assert stats["rollover_regions"] == [(15, 25)]
    assert round(stats["rollover_longest_ms"]) == 60 and stats["rollover_longest_frame"] == 24
    assert stats["longest_stall_ms"] >= stats["rollover_longest_ms"]
    assert stats["re_emissions"] == 3


def test_the_warm_up_counts_new_frames_from_the_first_prediction() -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_e2e import Deliveries, warm_up_stats

    # Scale frames 0-3 together at 2 s, then a frame each 30 ms until frame 40, 400 ms before frame 41
    # (a compile, say), then 25 ms; frame 60 emitted twice (the second later).
    d = Deliveries()
    clock = 2.0
    for frame in range(150):
        if frame >= 4:
            clock += 0.4 if frame == 41 else 0.030 if frame <= 40 else 0.025
        d.times.append(clock)
        d.frames.append(frame)
        if frame == 60:
            d.times.append(clock + 1.5)
            d.frames.append(60)
    stats = warm_up_stats(d, started=0.5)
    assert round(stats["longest_interval_after_first_prediction_ms"]) == 400
    assert stats["longest_interval_after_first_prediction_frame"] == 41
    expected_100th = 2.0 + 37 * 0.030 + 0.4 + 58 * 0.025  # frame 99's first emission
    assert abs(stats["prediction_100_s"] - (expected_100th - 0.5)) < 1e-9


def test_a_long_interval_is_split_into_engine_push_and_collector_time() -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    import gc

    from bench_e2e import CollectorPauses, Deliveries, stall_causes

    # Frames 0-9 first emitted every 25 ms, frame 6 after 90 ms: of those, push calls cover 20 ms before
    # frame 5's delivery and 50 ms after it, a collection 10 ms; an interval that starts before the
    # first frame is not one.
    d = Deliveries()
    clock = 0.0
    for frame in range(10):
        clock += 0.090 if frame == 6 else 0.025
        d.times.append(clock)
        d.frames.append(frame)
    frame5, frame6 = d.times[5], d.times[6]
    pushes = [(frame5 - 0.020, frame5 - 0.001), (frame5 + 0.010, frame5 + 0.060), (frame6 + 0.001, frame6 + 0.02)]
    pauses = [(frame5 + 0.070, frame5 + 0.080, 2)]
    causes = stall_causes(d, [{"ms": 90.0, "frame": 6, "rollover": False}, {"ms": 1.0, "frame": 0}], pushes, pauses)
    assert causes == [{"ms": 90.0, "frame": 6, "rollover": False, "in_push_ms": 50.0, "in_collector_ms": 10.0}]

    with CollectorPauses() as collector:
        gc.collect()
    assert collector not in gc.callbacks and collector._callback not in gc.callbacks
    summary = collector.summary()
    assert summary["collections"] >= 1 and summary["by_generation"][2] >= 1 and summary["longest_ms"] >= 0
