"""Frame sources on real media: OpenCV-encoded videos, image folders, a local MJPEG camera."""

from __future__ import annotations

import gc
import math
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import preprocess_path, to_float
from hypothesis import given, settings
from hypothesis import strategies as st
from media_helpers import (
    decoded_index,
    free_port,
    mjpeg_server,
    rss_bytes,
    silent_server,
    truncate_file,
    write_image_folder,
    write_noise_video,
    write_video,
)
from PIL import Image

from stream_recon.app.sources.frames import SourceError, TruncatedSourceError
from stream_recon.app.sources.opening import check_source, classify_source, natural_sort_key, open_source
from stream_recon.app.sources.readers import frames_source
from stream_recon.app.sources.settings import FrameSelection, Sampler

# ------------------------------------------------------------------ video files


def test_video_delivers_every_frame_in_order_with_pts(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 30, fps=20)

    with open_source(video) as source:
        frames = list(source)

    assert source.kind == "video" and source.name == "clip" and source.estimated_length == 30
    assert [frame.index for frame in frames] == list(range(30))
    assert [decoded_index(frame.rgb) for frame in frames] == list(range(30))
    np.testing.assert_allclose([frame.timestamp for frame in frames], np.arange(30) / 20, atol=1e-6)
    assert frames[0].rgb.shape == (96, 160, 3) and frames[0].image is None
    assert source.end_reason == "end"


def test_video_frames_are_preprocessed_in_the_reader_when_asked(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 3, width=160, height=96)

    with open_source(video, image_width=224) as source:
        frames = list(source)

    # 96 * 224 / 160 / 14 = 9.6 patch rows -> 10 -> 140 rows
    assert tuple(frames[0].image.shape) == (3, 140, 224)
    assert frames[0].rgb is None  # the decoded frame is not kept once preprocessed


def test_start_stride_and_max_frames_pick_source_frames(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.avi", 40, fourcc="MJPG")
    selection = FrameSelection(start=5, stride=3, max_frames=4)

    with open_source(video, selection) as source:
        frames = list(source)

    assert [frame.source_index for frame in frames] == [5, 8, 11, 14]
    assert [decoded_index(frame.rgb) for frame in frames] == [5, 8, 11, 14]
    assert [frame.index for frame in frames] == [0, 1, 2, 3]
    assert source.estimated_length == 4 and source.end_reason == "max_frames"


def test_fps_subsamples_by_timestamp(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 50, fps=25)  # 2 s

    with open_source(video, FrameSelection(fps=10)) as source:
        timestamps = [frame.timestamp for frame in source]

    # the first frame at or after every 0.1 s tick: 0, 0.12, 0.2, 0.32, 0.4, ...
    np.testing.assert_allclose(timestamps[:5], [0.0, 0.12, 0.2, 0.32, 0.4], atol=1e-6)
    assert len(timestamps) == 20
    assert source.estimated_length == 20


@settings(deadline=None)  # a busy CI machine must not turn a slow example into a failure
@given(
    source_fps=st.floats(1.0, 120.0),
    target_fps=st.floats(0.5, 60.0),
    num_frames=st.integers(1, 400),
)
def test_fps_keeps_at_most_one_frame_per_tick_and_one_in_every_tick(
    source_fps: float, target_fps: float, num_frames: int
) -> None:
    sampler = Sampler(FrameSelection(fps=target_fps))
    timestamps = np.arange(num_frames) / source_fps
    kept = [t for index, t in enumerate(timestamps) if sampler.accept(index, t)]

    ticks = [math.floor(t * target_fps + 1e-6) for t in kept]
    assert kept[0] == 0.0
    assert len(set(ticks)) == len(ticks)  # never two frames in one tick
    if source_fps >= target_fps:  # every tick that holds a frame keeps one
        holding = {math.floor(t * target_fps + 1e-6) for t in timestamps}
        assert set(ticks) == holding


def test_selection_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="--stride must be >= 1"):
        FrameSelection(stride=0)
    with pytest.raises(ValueError, match="--fps must be a positive number"):
        FrameSelection(fps=0)
    with pytest.raises(ValueError, match="--max-frames must be >= 1"):
        FrameSelection(max_frames=0)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="no such file or folder: .*nothere.mp4"):
        open_source(tmp_path / "nothere.mp4")


def test_text_file_named_mp4_says_it_is_not_a_video(tmp_path: Path) -> None:
    fake = tmp_path / "holiday.mp4"
    fake.write_text("this is a shopping list, not a video\n")

    with pytest.raises(SourceError, match=r"holiday.mp4 is not a video file \(its content looks like text"):
        open_source(fake)


def test_png_named_mp4_says_what_it_is(tmp_path: Path) -> None:
    fake = tmp_path / "clip.mp4"
    Image.new("RGB", (8, 8)).save(fake, format="PNG")

    with pytest.raises(SourceError, match="looks like a PNG image"):
        open_source(fake)


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "empty.mp4").touch()
    with pytest.raises(SourceError, match="empty.mp4 is empty"):
        open_source(tmp_path / "empty.mp4")



def test_the_check_before_opening_refuses_in_the_words_of_the_opening(tmp_path: Path) -> None:
    # the CLI checks a source before it imports torch; what it says must be what opening it would say
    (tmp_path / "empty.mp4").touch()
    (tmp_path / "notes.mp4").write_text("shopping list\n")
    Image.new("RGB", (8, 8)).save(tmp_path / "one.png")
    (tmp_path / "nothing").mkdir()
    write_image_folder(tmp_path / "nested" / "rgb", ["000000.png", "000001.png"])
    refused = [tmp_path / "nothere.mp4", tmp_path / "empty.mp4", tmp_path / "notes.mp4", tmp_path / "one.png",
               tmp_path / "nothing", tmp_path / "nested", "ftp://camera.local/live", "  "]
    for spec in refused:
        with pytest.raises(SourceError) as opening:
            open_source(spec)
        with pytest.raises(SourceError) as checking:
            check_source(spec)
        assert str(checking.value) == str(opening.value)
    # what only opening tells (a camera, a stream) is left to it: nothing is connected to here
    started = time.monotonic()
    for spec in (write_video(tmp_path / "clip.mp4", 3), tmp_path / "nested" / "rgb", "7", "rtsp://192.0.2.1:554/live"):
        check_source(spec)
    assert time.monotonic() - started < 1.0


def test_truncated_mp4_without_its_index_is_named_truncated(tmp_path: Path) -> None:
    # OpenCV's MP4 muxer writes the index (moov) last, so a cut-off recording has none
    video = truncate_file(write_video(tmp_path / "cut.mp4", 30), 0.6)

    with pytest.raises(SourceError, match="cut.mp4 looks like an MP4/MOV file .* truncated or damaged"):
        open_source(video)


def test_truncated_avi_delivers_frames_up_to_the_damage_then_says_so(tmp_path: Path) -> None:
    video = truncate_file(write_video(tmp_path / "cut.avi", 40, fourcc="MJPG"), 0.5)

    delivered = []
    with open_source(video) as source, pytest.raises(TruncatedSourceError) as raised:
        for frame in source:
            delivered.append(decoded_index(frame.rgb))

    error = raised.value
    assert 10 < len(delivered) < 40
    assert delivered == list(range(len(delivered)))
    assert error.frames_decoded == len(delivered) and error.frames_expected == 40
    assert f"stopped decoding after {len(delivered)} of 40 frames" in str(error)
    assert "truncated or damaged" in str(error)


def test_single_image_is_refused_with_the_folder_to_use(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "seq", ["a.png"])
    with pytest.raises(SourceError, match=r"a.png is a single image; pass the folder .*seq"):
        open_source(tmp_path / "seq" / "a.png")


@pytest.mark.slow
def test_host_memory_stays_flat_over_a_long_video(tmp_path: Path) -> None:
    # 100 frames of 640x480 RGB are 92 MB decoded; a bounded queue holds 8 (7 MB)
    video = write_noise_video(tmp_path / "long.avi", 100, 640, 480)
    gc.collect()

    with open_source(video, image_width=518) as source:
        for frame in source:
            if frame.index == 20:
                baseline = rss_bytes()
            time.sleep(0.001)  # a consumer slower than the decoder keeps the queue full
        growth = rss_bytes() - baseline

    assert frame.index == 99
    assert growth < 40 * 2**20, f"host memory grew by {growth / 2**20:.0f} MB while streaming"


def test_preprocessing_threads_deliver_model_inputs_in_reading_order() -> None:
    # Every third frame is large and slow to resize, so three threads finish frames out of order; each
    # frame is one flat colour (its index), which a resize keeps.
    def camera():
        for index in range(24):
            width = 1400 if index % 3 == 0 else 70
            yield np.full((width * 3 // 4, width, 3), index, dtype=np.uint8), 0.5 * index

    with frames_source(camera(), image_width=56, preprocess_workers=3, pool_from_pixels=0) as source:
        frames = list(source)

    assert [frame.index for frame in frames] == list(range(24))
    assert [frame.timestamp for frame in frames] == [0.5 * index for index in range(24)]
    for index, frame in enumerate(frames):
        assert frame.rgb is None and frame.image.dtype == np.uint8 and tuple(frame.image.shape) == (3, 42, 56)
        assert (frame.image == index).all()


def test_the_reader_makes_model_inputs_up_to_pool_from_pixels_and_the_pool_larger_ones_in_reading_order(
        monkeypatch) -> None:
    from stream_recon.app.sources import reader

    made_on: dict[int, str] = {}
    preprocess = reader.preprocess_frame_uint8

    def preprocess_frame(rgb, width):
        made_on[int(rgb[0, 0, 0])] = threading.current_thread().name
        return preprocess(rgb, width)

    def camera():  # every third frame over 1280x720, the rest well under it; each one flat colour, its index
        for index in range(12):
            width = 1600 if index % 3 == 0 else 640
            yield np.full((width * 9 // 16, width, 3), index, dtype=np.uint8), 0.5 * index

    monkeypatch.setattr(reader, "preprocess_frame_uint8", preprocess_frame)
    with frames_source(camera(), name="cam", image_width=56, preprocess_workers=2) as source:
        frames = list(source)

    assert [frame.index for frame in frames] == list(range(12))
    assert [int(frame.image[0, 0, 0]) for frame in frames] == list(range(12))
    assert all(frame.rgb is None and frame.image.dtype == np.uint8 for frame in frames)
    assert {index for index, thread in made_on.items() if thread == "reader:cam"} == {
        index for index in range(12) if index % 3}
    assert all(made_on[index].startswith("preprocess:cam") for index in range(0, 12, 3))


def test_a_slow_consumer_holds_the_reader_back_to_one_queue_of_frames() -> None:
    pulled: list[int] = []

    def camera():
        for index in range(60):
            pulled.append(index)
            yield np.full((48, 64, 3), index, dtype=np.uint8), float(index)

    with frames_source(camera(), image_width=56, queue_size=4, preprocess_workers=2, pool_from_pixels=0) as source:
        frames = iter(source)
        first = next(frames)
        settled = wait_until_unchanged(lambda: len(pulled))
        # one frame delivered, four queued (done or being resized), one the reader holds while it waits
        assert settled <= 1 + 4 + 1
        rest = list(frames)

    assert [frame.index for frame in (first, *rest)] == list(range(60))
    assert [int(frame.image[0, 0, 0]) for frame in (first, *rest)] == list(range(60))


def wait_until_unchanged(read, quiet_s: float = 0.3, limit_s: float = 10.0):
    """The value of `read()` once it has stopped changing for `quiet_s` (a reader thread that blocked)."""
    value, since, deadline = read(), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.02)
        if read() != value:
            value, since = read(), time.monotonic()
    return value


def test_close_stops_the_reader_thread_early(tmp_path: Path) -> None:
    video = write_video(tmp_path / "clip.mp4", 200)
    source = open_source(video)

    iterator = iter(source)
    next(iterator)
    source.close()

    assert not any(thread.name == "reader:clip" for thread in threading.enumerate())


# ------------------------------------------------------------------ image folders


def test_folder_is_naturally_sorted_and_timed_by_file_order(tmp_path: Path) -> None:
    names = ["frame1.png", "frame2.png", "frame10.png", "frame11.png"]
    folder = write_image_folder(tmp_path / "seq", names)
    (folder / "notes.txt").write_text("not a frame")
    (folder / ".hidden.png").write_bytes(b"")

    with open_source(folder, FrameSelection(fps=4)) as source:
        frames = list(source)

    assert source.kind == "folder" and source.name == "seq" and source.estimated_length == 4
    assert [decoded_index(frame.rgb) for frame in frames] == [0, 1, 2, 3]  # written in that order
    assert [frame.timestamp for frame in frames] == [0.0, 0.25, 0.5, 0.75]


def test_natural_sort_key_orders_numbers_by_value() -> None:
    names = ["img10.jpg", "img9.jpg", "IMG1.jpg", "img100.jpg"]
    assert sorted(names, key=natural_sort_key) == ["IMG1.jpg", "img9.jpg", "img10.jpg", "img100.jpg"]


def test_folder_frames_match_the_reference_crop_rule(tmp_path: Path) -> None:
    # RGBA and EXIF handling must be the same as for a single file
    folder = tmp_path / "rgba"
    folder.mkdir()
    rng = np.random.default_rng(1)
    for index in range(2):
        pixels = rng.integers(0, 256, size=(90, 120, 4), dtype=np.uint8)
        Image.fromarray(pixels, mode="RGBA").save(folder / f"{index}.png")

    with open_source(folder, image_width=112) as source:
        frames = list(source)

    for index, frame in enumerate(frames):
        assert frame.image is not None and frame.image.dtype == np.uint8  # the engine makes it float
        np.testing.assert_array_equal(to_float(frame.image), preprocess_path(folder / f"{index}.png", image_width=112))


def test_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("x")
    with pytest.raises(SourceError, match="empty contains no images .*pass a folder of frames"):
        open_source(tmp_path / "empty")


def test_folder_with_frames_one_level_down_names_the_subfolders(tmp_path: Path) -> None:
    write_image_folder(tmp_path / "tum" / "rgb", ["1.png"])
    write_image_folder(tmp_path / "tum" / "depth", ["1.png"])
    with pytest.raises(SourceError, match="its subfolders depth, rgb do: pass one of them"):
        open_source(tmp_path / "tum")


def test_folder_of_mixed_sizes_names_both_files(tmp_path: Path) -> None:
    folder = write_image_folder(tmp_path / "mixed", ["0.png", "1.png"], width=64, height=48)
    write_image_folder(folder, ["2.png"], width=48, height=64)

    with pytest.raises(SourceError, match="different sizes: 0.png is 64x48 but 2.png is 48x64"):
        open_source(folder)


def test_odd_size_between_the_sampled_headers_is_caught_while_reading(tmp_path: Path) -> None:
    from stream_recon.app.sources.opening import _check_one_size

    folder = write_image_folder(tmp_path / "seq", [f"{index}.png" for index in range(9)], width=64, height=48)
    write_image_folder(folder, ["5.png"], width=48, height=64)  # overwrite one file in the middle
    paths = sorted(folder.iterdir(), key=lambda path: natural_sort_key(path.name))
    assert _check_one_size(paths, max_checked=3) == (64, 48)  # samples 0, 4, 8: misses 5.png

    # the reader checks every frame: a file that differs from the first is an error when it comes up
    folder = write_image_folder(tmp_path / "seq2", [f"{index}.png" for index in range(9)], width=64, height=48)
    source = open_source(folder)
    write_image_folder(folder, ["5.png"], width=48, height=64)
    delivered = []
    with source, pytest.raises(SourceError, match="different sizes: 0.png is 64x48 but 5.png is 48x64"):
        for frame in source:
            delivered.append(frame.source_index)

    assert delivered == [0, 1, 2, 3, 4]


def test_folder_error_mid_stream_comes_after_the_good_frames(tmp_path: Path) -> None:
    folder = write_image_folder(tmp_path / "seq", [f"{index}.png" for index in range(6)])
    source = open_source(folder)
    (folder / "3.png").unlink()  # gone between opening and reading

    delivered = []
    with source, pytest.raises(SourceError, match="3.png"):
        for frame in source:
            delivered.append(frame.source_index)

    assert delivered == [0, 1, 2]


# ------------------------------------------------------------------ live sources


def test_mjpeg_http_camera_streams_live_frames() -> None:
    # with reconnection off, the camera's stream ending is the end (tests/test_app_live_sources.py
    # has reconnection against servers that are killed and restarted)
    with mjpeg_server(num_frames=25) as url, open_source(url, reconnect_s=0) as source:
        frames = list(source)

    assert source.kind == "stream" and source.live and source.estimated_length is None
    assert len(frames) + source.frames_dropped == 25
    timestamps = [frame.timestamp for frame in frames]
    assert timestamps[0] == 0.0 and timestamps == sorted(timestamps)
    assert frames[0].rgb.shape == (96, 160, 3)


def test_live_source_stops_at_max_frames() -> None:
    with mjpeg_server(num_frames=1000) as url, open_source(url, FrameSelection(max_frames=5)) as source:
        frames = list(source)

    assert [frame.index for frame in frames] == [0, 1, 2, 3, 4]
    assert source.end_reason == "max_frames"


# The time bounds below are the open and frame timeouts themselves, said in the errors; pytest-timeout
# only turns a hang (a timeout not honoured) into a failure, far above what any of these takes.


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_unreachable_stream_fails_after_its_open_timeout() -> None:
    with silent_server() as port:
        with pytest.raises(SourceError, match=r"could not (open stream|connect to) http://127.0.0.1.* 1 s"):
            open_source(f"http://127.0.0.1:{port}/live", open_timeout_s=1.0)


@pytest.mark.timeout(30)
def test_refused_stream_fails_without_waiting_for_the_open_timeout() -> None:
    # a refused connection is known at once: waiting out these 120 s would trip the test's timeout
    with pytest.raises(SourceError, match="check the address"):
        open_source(f"rtsp://127.0.0.1:{free_port()}/cam", open_timeout_s=120.0)


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_stalled_stream_becomes_an_error_not_a_hang() -> None:
    with mjpeg_server(stall_after=3) as url:
        source = open_source(url, open_timeout_s=5.0, frame_timeout_s=0.5)
        frames = []
        with source, pytest.raises(SourceError, match="for 0.5 s: the source stalled"):
            for frame in source:
                frames.append(frame)
    assert len(frames) == 3  # everything the camera sent before it stalled


def test_long_skip_is_not_mistaken_for_a_stall() -> None:
    def slow_camera():
        for index in range(30):
            time.sleep(0.05)  # 25 skipped frames take 1.25 s, more than the frame timeout
            yield np.zeros((8, 8, 3), dtype=np.uint8), index / 20

    with frames_source(slow_camera(), FrameSelection(start=25), frame_timeout_s=0.5) as source:
        frames = list(source)

    assert [frame.source_index for frame in frames] == [25, 26, 27, 28, 29]


def test_generator_source_checks_each_item() -> None:
    def bad_camera():
        yield np.zeros((8, 8, 3), dtype=np.uint8), 0.0
        yield np.zeros((8, 8), dtype=np.float32), 0.1

    with frames_source(bad_camera(), name="cam") as source, pytest.raises(
        SourceError, match=r"cam: item 1 is not an RGB frame \[H, W, 3\] uint8"
    ):
        list(source)


def test_missing_webcam() -> None:
    with pytest.raises(SourceError, match="could not open webcam 9"):
        open_source("9")


def test_source_classification() -> None:
    assert classify_source("0") == ("webcam", "0")
    assert classify_source("rtsp://cam.local/stream") == ("stream", "rtsp://cam.local/stream")
    with pytest.raises(SourceError, match="unsupported URL scheme 'ftp'"):
        classify_source("ftp://example.com/video.mp4")


def test_a_stop_signal_while_the_reader_starts_never_leaves_its_capture_to_the_main_thread(tmp_path, monkeypatch):
    """A Ctrl-C or SIGTERM raised between the reader thread's start and its record left the source believing no
    thread read it: close() released the capture from the main thread under the reader's read, and FFmpeg
    deadlocked both (a stopped run that never ended). The signal lands right after the thread starts here."""
    import signal

    from stream_recon.app.sources import reader as reader_module
    from stream_recon.app.stopping import PromptInterrupt

    video = write_noise_video(tmp_path / "noise.avi", num_frames=30, width=320, height=240)
    start_thread = reader_module.start_supervised_thread

    def start_then_signal(*args, **kwargs):
        thread = start_thread(*args, **kwargs)
        signal.raise_signal(signal.SIGINT)  # (its handler runs before this function returns)
        return thread

    monkeypatch.setattr(reader_module, "start_supervised_thread", start_then_signal)
    released_on = []
    with open_source(video) as source:
        release = source._reader.release
        monkeypatch.setattr(source._reader, "release", lambda: released_on.append(threading.current_thread()) or release())
        with PromptInterrupt(), pytest.raises(KeyboardInterrupt):
            source.start()
        source.close()
    assert threading.main_thread() not in released_on
