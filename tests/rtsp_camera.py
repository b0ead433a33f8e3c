"""An RTSP camera on 127.0.0.1 for the live-source tests: GStreamer's RTSP server playing a clip as H.264.

Run it with a Python that has GStreamer's introspection bindings (Debian's python3-gi, so usually
/usr/bin/python3, not the project's venv):

    python3 tests/rtsp_camera.py --port 8554 --clip clip.avi [--fps 20] [--lifetime 60]
    python3 tests/rtsp_camera.py --check      # exit 0 if this Python can serve, else say what is missing

It prints `ready rtsp://127.0.0.1:PORT/cam` once it accepts connections. Every client gets the
clip's frames in a loop, re-encoded as H.264 and timestamped as they are sent, the way an IP camera
streams: the session has no duration, so a client cannot tell it from a live camera. The process
exits by itself after --lifetime seconds, so a test that dies cannot leave it behind.

Debian packages: gir1.2-gst-rtsp-server-1.0 python3-gi gstreamer1.0-plugins-base
gstreamer1.0-plugins-good gstreamer1.0-plugins-bad (openh264enc).
"""

from __future__ import annotations

import argparse
import sys

try:
    import gi

    gi.require_version("Gst", "1.0")
    gi.require_version("GstRtspServer", "1.0")
    from gi.repository import GLib, Gst, GstRtspServer
except (ImportError, ValueError) as error:  # ValueError: gi is there, the typelib is not
    IMPORT_ERROR: str | None = f"{type(error).__name__}: {error}"
else:
    IMPORT_ERROR = None

MOUNT = "/cam"
# The camera's side of the session: raw frames in, RTP H.264 out. A key frame every 10 frames, so a
# client that (re)connects decodes within half a second, as real cameras are usually set up.
CAMERA_PIPELINE = (
    "( appsrc name=camera is-live=true format=time ! videoconvert ! "
    "openh264enc gop-size=10 bitrate=2000000 ! h264parse ! rtph264pay name=pay0 pt=96 config-interval=-1 )"
)
ELEMENTS = ("appsrc", "videoconvert", "openh264enc", "h264parse", "rtph264pay", "filesrc", "decodebin", "appsink")


def missing_pieces() -> str | None:
    """What this Python lacks to serve (None: nothing)."""
    if IMPORT_ERROR is not None:
        return f"GStreamer's RTSP server bindings cannot be imported ({IMPORT_ERROR})"
    Gst.init(None)
    absent = [name for name in ELEMENTS if Gst.ElementFactory.find(name) is None]
    return f"GStreamer elements missing: {', '.join(absent)}" if absent else None


def decode_clip(path: str) -> tuple[Gst.Caps, list[bytes]]:
    """Every frame of the clip as raw I420 bytes, with their caps (the clip is a few MB at most)."""
    decoder = Gst.parse_launch(
        f'filesrc location="{path}" ! decodebin ! videoconvert ! video/x-raw,format=I420 ! '
        "appsink name=frames sync=false"
    )
    sink = decoder.get_by_name("frames")
    decoder.set_state(Gst.State.PLAYING)
    frames: list[bytes] = []
    caps = None
    while True:
        sample = sink.emit("pull-sample")  # None at the end of the clip
        if sample is None:
            break
        caps = sample.get_caps()
        buffer = sample.get_buffer()
        frames.append(buffer.extract_dup(0, buffer.get_size()))
    decoder.set_state(Gst.State.NULL)
    if not frames:
        raise SystemExit(f"no frame could be decoded from {path}")
    return caps, frames


def camera_factory(caps: Gst.Caps, frames: list[bytes], fps: int) -> GstRtspServer.RTSPMediaFactory:
    """One media per client; each plays the decoded clip from its first frame, looping."""
    factory = GstRtspServer.RTSPMediaFactory()
    factory.set_launch(CAMERA_PIPELINE)
    frame_ns = Gst.SECOND // fps

    def on_media_configure(_factory: object, media: GstRtspServer.RTSPMedia) -> None:
        source = media.get_element().get_child_by_name("camera")
        source.set_property("caps", caps)
        sent = [0]

        def need_data(appsrc: Gst.Element, _length: int) -> None:
            # the sink paces the stream against the clock, so the timestamps set the frame rate
            buffer = Gst.Buffer.new_wrapped(frames[sent[0] % len(frames)])
            buffer.pts = sent[0] * frame_ns
            buffer.duration = frame_ns
            sent[0] += 1
            appsrc.emit("push-buffer", buffer)

        source.connect("need-data", need_data)

    factory.connect("media-configure", on_media_configure)
    return factory


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether this Python can serve")
    parser.add_argument("--port", type=int)
    parser.add_argument("--clip")
    parser.add_argument("--fps", type=int, default=20)
    parser.add_argument("--lifetime", type=float, default=120.0, help="seconds before the server exits")
    args = parser.parse_args()

    missing = missing_pieces()
    if args.check or missing:
        print(missing or "ok")
        return 1 if missing else 0
    if args.port is None or args.clip is None:
        parser.error("--port and --clip are needed to serve")
    caps, frames = decode_clip(args.clip)
    server = GstRtspServer.RTSPServer()
    server.set_address("127.0.0.1")
    server.set_service(str(args.port))
    server.get_mount_points().add_factory(MOUNT, camera_factory(caps, frames, args.fps))
    if server.attach(None) == 0:
        raise SystemExit(f"could not listen on 127.0.0.1:{args.port}")
    loop = GLib.MainLoop()
    GLib.timeout_add(int(args.lifetime * 1000), loop.quit)
    print(f"ready rtsp://127.0.0.1:{args.port}{MOUNT}", flush=True)
    loop.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
