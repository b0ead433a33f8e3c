"""What loop closure costs the stream: `stream-recon VIDEO` (run_sequence, every output written) on the same
video with --loop-closure off and on, in one process.

    python scripts/bench_loop_closure.py --frames 3000                 # GPU: the acceptance measurement
    python scripts/bench_loop_closure.py --frames 10000 --modes on --refine   # GPU: refine of a 10,000-frame run
    python scripts/bench_loop_closure.py --frames 10000 --modes on --refine --extend 1000   # and --map after it
    python scripts/bench_loop_closure.py --model tiny --device cpu --frames 48 --chunk-frames 12 --overlap 4 \
        --warmup-frames 12 --image-width 112 --video-size 160x120   # a smoke test of the script (seconds)

The video is scripts/bench_e2e.py's (the sample frames played forwards and backwards while a crop pans),
so the camera keeps returning to places it has seen: every chunk from the third on has loop candidates,
which is loop closure's heaviest case. `--scene DIR` makes it from a recorded scene instead (a folder of
images or a video, e.g. an example scene of the official repository), played forwards and backwards.
Order: a short warm-up run (every step compiled and recorded), then the measured runs alternating off,
on (`--pairs` times). Per run: steady FPS, p50 / p99, frame
intervals over twice the median (and whether a rollover was in them), and for `on` what run.json says
of loop closure (keyframes indexed, the indexing spacing at the start and the end, indexed keyframes per
100 frames and the longest stretch of frames without one, loops accepted and rejected, milliseconds per
call of each stage). Prints a table; --json writes everything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import bench_e2e  # noqa: E402


def measured_run(args: argparse.Namespace, video: Path, mode: str, frames: int, model: Any, device: str,
                 extend_map: str | None = None) -> dict:
    kept = args.refine or args.extend or args.keep
    output = tempfile.mkdtemp(prefix="bench_loop_closure_", dir=args.video_dir) if kept else args.output
    run_args = argparse.Namespace(**{**vars(args), "loop_closure": mode, "frames": frames, "output": output})
    options = bench_e2e.run_options(run_args, bench_e2e.free_port())
    if extend_map is not None:
        options = dataclasses.replace(options, extend_map=extend_map)
    result = bench_e2e.product_run(run_args, video, options, model, device)
    keep = ("steady_fps", "p50_ms", "p99_ms", "longest_stall_ms", "longest_stall_frame", "longest_stall_at_rollover",
            "over_2x_median", "rollovers", "frames", "keyframes", "run_json_fps", "loop_closure", "after_last_frame_s",
            "run_s")
    return {"mode": mode, "output": output, **{key: result.get(key) for key in keep}, "refine": None}


def second_recording(video: Path, frames: int) -> Path:
    """Another video of the same place: the last `frames` frames of `video`, played backwards (the camera
    walks the path the other way, so its keyframes are new pictures of places the first run mapped)."""
    import cv2

    path = video.with_name(f"{video.stem}_last{frames}_backwards.mp4")
    if path.exists():
        return path
    capture = cv2.VideoCapture(str(video))
    last: list = []
    while True:
        ok, frame = capture.read()
        if not ok:
            break
        last = (last + [frame])[-frames:]
    capture.release()
    height, width = last[0].shape[:2]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 30.0, (width, height))
    for frame in reversed(last):
        writer.write(frame)
    writer.release()
    return path


def extended_runs(args: argparse.Namespace, video: Path, earlier_run: str, model: Any, device: str) -> dict:
    """The second recording streamed with loop closure on, without then with `--map` the earlier run, then without
    again (the machine drifts; the ratio is against the mean of the two runs around it)."""
    second = second_recording(video, args.extend)
    runs = []
    for earlier in (None, earlier_run, None):
        run_args = argparse.Namespace(**{**vars(args), "frames": args.extend, "refine": False})
        run = measured_run(run_args, second, "on", args.extend, model, device, extend_map=earlier)
        runs.append({**run, "map": earlier})
        print_run(run)
    alone = [run["steady_fps"] for run in runs if run["map"] is None]
    ratio = runs[1]["steady_fps"] / (sum(alone) / len(alone))
    placed = (runs[1]["loop_closure"] or {}).get("map")
    print(f"--map: {runs[1]['steady_fps']:.1f} FPS steady against {sum(alone) / len(alone):.1f} without it "
          f"({ratio:.3f}); the map: {placed}")
    return {"video": str(second), "runs": runs, "map_over_alone": ratio}


def refined_run(run_dir: Path) -> dict:
    """`stream-recon refine` of a run just made, timed: its summary.refine and the whole command's seconds."""
    from stream_recon.app.outputs.refined import refine_run

    started = time.perf_counter()
    result = refine_run(run_dir)
    refine = json.loads((run_dir / "run.json").read_text())["summary"]["refine"]
    return {**refine, "command_s": round(time.perf_counter() - started, 3), "frames": result.frames,
            "swap_s": round(result.swap_seconds, 3), "end_s": round(result.end_seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=3000)
    parser.add_argument("--warmup-frames", type=int, default=120)
    parser.add_argument("--pairs", type=int, default=1, help="off/on pairs to run")
    parser.add_argument("--modes", default="off,on", help="the --loop-closure modes of each pair, in order")
    parser.add_argument("--video-size", default="640x468")
    parser.add_argument("--model", default="lingbot-map")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--chunk-frames", type=int, default=320)
    parser.add_argument("--overlap", type=int, default=16)
    parser.add_argument("--keyframes", default="all")
    parser.add_argument("--image-width", type=int, default=518, help="model input width")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto", help="the runs' --compile")
    parser.add_argument("--video", help="a video file instead of the one made from app/sample")
    parser.add_argument("--scene", help="a recorded scene (a folder of images, or a video) played forwards and backwards "
                        "to --frames at --video-size, instead of the video made from app/sample")
    parser.add_argument("--order", default="pingpong",
                        help="with --scene: pingpong, walk:SEED (a seeded random walk over 40 frames) or tour:LAPS")
    parser.add_argument("--video-dir", default=tempfile.gettempdir())
    parser.add_argument("--json")
    parser.add_argument("--log", help="stream-recon's log (INFO and up) into this file, as the runs go")
    parser.add_argument("--refine", action="store_true",
                        help="after each `on` run, refine its run directory (stream-recon refine) and time it")
    parser.add_argument("--keep", action="store_true",
                        help="keep each run's directory in --video-dir (its path in the JSON's `output`), for a later "
                        "refine or --map")
    parser.add_argument("--extend", type=int, default=0, metavar="FRAMES",
                        help="after the last `on` run: a second recording of FRAMES frames (that run's last ones, "
                        "backwards) streamed without, with `--map` that run, and without again")
    args = parser.parse_args()
    # every other setting as scripts/bench_e2e.py's defaults
    args = argparse.Namespace(**{**vars(bench_e2e.argument_parser().parse_args([])), **vars(args)})
    if args.log:
        bench_e2e.log_to_file(args.log)

    import torch

    from stream_recon.app.options import resolve_device

    width, height = (int(side) for side in args.video_size.split("x"))
    if args.video:
        video = Path(args.video)
    elif args.scene:
        order = args.order.replace(":", "")
        video = Path(args.video_dir) / f"scene_{Path(args.scene).stem}_{order}_{args.frames}_{width}x{height}.mp4"
        if not video.exists():
            bench_e2e.make_scene_video(video, Path(args.scene), args.frames, width, height, order=args.order)
    else:
        video = Path(args.video_dir) / f"bench_e2e_{args.frames}_{width}x{height}.mp4"
        if not video.exists():
            bench_e2e.make_video(video, args.frames, width, height)
    print(f"video ready: {video}", flush=True)
    options = bench_e2e.run_options(args, bench_e2e.free_port())
    device = resolve_device(options.device)
    model, load_s = bench_e2e.build_model(args)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "settings": vars(args), "model_load_s": load_s,
        "warmup": measured_run(args, video, "off", args.warmup_frames, model, device), "runs": [],
    }
    for _ in range(args.pairs):
        for mode in args.modes.split(","):
            run = measured_run(args, video, mode, args.frames, model, device)
            result["runs"].append(run)
            print_run(run)  # (each figure printed and written as it comes: a call cut short keeps them)
            write_json(args.json, result)
            if args.refine and mode == "on":
                run["refine"] = refined_run(Path(run["output"]))
                print_refine(run["refine"])
                write_json(args.json, result)
    mapped = [run["output"] for run in result["runs"] if run["mode"] == "on"]
    if args.extend and mapped:
        result["extend"] = extended_runs(args, video, mapped[-1], model, device)
    off = [run["steady_fps"] for run in result["runs"] if run["mode"] == "off"]
    on = [run["steady_fps"] for run in result["runs"] if run["mode"] == "on"]
    if on and off:
        result["on_over_off"] = sum(on) / sum(off)
        print(f"steady FPS with loop closure / without: {result['on_over_off']:.3f}")
    write_json(args.json, result)


def write_json(path: str | None, result: dict) -> None:
    if path:
        Path(path).write_text(json.dumps(bench_e2e.without_nan(result), indent=1) + "\n")


def print_run(run: dict) -> None:
    loops = run.get("loop_closure") or {}
    over = run["over_2x_median"] or []
    print(f"{run['mode']:>3}: {run['steady_fps']:.1f} FPS steady, p50 {run['p50_ms']:.1f} ms, p99 {run['p99_ms']:.1f} ms, "
          f"{len(over)} intervals > 2x median ({sum(not o['rollover'] for o in over)} away from rollovers), "
          f"longest {run['longest_stall_ms']:.0f} ms at frame {run['longest_stall_frame']}; "
          f"loop closure: {loops.get('mode')}, {loops.get('accepted', '-')} accepted, "
          f"{loops.get('rejected', '-')} rejected, {loops.get('keyframes_indexed', '-')} keyframes indexed "
          f"(spacing {loops.get('index_spacing')}, {loops.get('indexed_per_100_frames', '-')} per 100 frames, "
          f"longest stretch without one {loops.get('longest_unindexed_stretch', '-')} frames, "
          f"{loops.get('keyframes_deferred', '-')} due keyframes deferred); costs {loops.get('costs_ms')}; "
          f"{run['after_last_frame_s']:.1f} s from the last frame to the run's end "
          f"({loops.get('end_wait_s', '-')} s of it waiting for loop closure)")


def print_refine(refine: dict) -> None:
    print(f"     refine: {refine['command_s']:.1f} s for {refine['frames']} frames ({refine['keyframes_indexed']} "
          f"keyframes indexed, {refine.get('keyframes_matched', '-')} matched, {refine.get('pairs_retrieved', '-')} "
          f"pairs retrieved, {refine['pairs_checked']} checked, {refine['loops_accepted']} of "
          f"{refine['loops_verified'] + refine['stream_loops']} loops accepted, {refine['nodes']} segments; "
          f"seconds by stage {refine['seconds']}; then the swap {refine.get('swap_s', '-')} s and the workers' end "
          f"{refine.get('end_s', '-')} s)", flush=True)


if __name__ == "__main__":
    main()
