"""Where the time goes at a chunk rollover, on the product path (GPU machine).

    python3 scripts/probes/trace_rollover.py [--pace X] [--main-priority P] [--spare-sm-share S] [--trace-before S] [--trace-after S] [--longest N] [--memory-push K] [--profile-push K[,K...] | --host-profile-push K[,K...]] [bench_e2e options, e.g. --frames 700 --viewer --client]

Runs scripts/bench_e2e.py in this process with timers wrapped around the rollover's parts (closing
the chunk, provisional frames beside the catching-up spare, pacing, the switch, aligning, emitting
to the sinks) and CUDA events around every engine step, main stream and spare alike. `--pace` and
`--main-priority` set models.stream.rollover's PACE and MAIN_STREAM_PRIORITY for the run, `--spare-sm-share`
models.stream.lookahead's SPARE_SM_SHARE. Prints, for each
rollover of the product run, the spans from a few frames before it to a few after (and those begun
earlier that still ran then), in ms from the rollover's start: host spans on the main thread, the
spare's jobs on its worker, when each step's device work began and ended (a scale step's also on a
line of its own), every CUDA stream or event call that took 0.5 ms or more (with its
thread's CPU time in it: little CPU means a wait for a lock or the interpreter), and the caching
allocator's cudaMalloc/cudaFree calls during each push; then the same around the product run's N
longest intervals between two pushes (`--longest N`, 4 by default), wherever they fell, in ms from
the start of the push that began each. `--memory-push K` also lists the caching allocator's device
calls (cudaMalloc, cudaFree) from the run's start (its warm-up) through push K, each with the push it
fell in, its stream and the lines of ours that asked. `--profile-push K[,K...]` runs those pushes
under torch.profiler and prints their operators by device time; `--host-profile-push` runs them under
cProfile and prints their Python calls by cumulative time.
"""

from __future__ import annotations

import bisect
import contextlib
import cProfile
import functools
import pstats
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: bench.py, bench_e2e.py
import bench_e2e  # noqa: E402

from stream_recon.app.run import pipeline, streaming  # noqa: E402
from stream_recon.models.stream import chunks, lookahead, rollover, similarity  # noqa: E402
from stream_recon.models.stream.chunked import ChunkedEngine  # noqa: E402
from stream_recon.models.stream.engine import StreamingEngine  # noqa: E402
from stream_recon.models.stream.lookahead import SpareEngine  # noqa: E402

SPANS: list[tuple[str, str, float, float]] = []  # (what, thread, start, end), perf_counter seconds
DEVICE: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []  # (what, thread, begin, end)
ROLLOVERS: list[float] = []
PUSHES: list[float] = []  # perf_counter seconds at each ChunkedEngine.push's start
LONGEST = 4  # intervals between pushes printed with their spans (--longest)
PHASE = {"product": False}
TRACE_BEFORE_S, TRACE_AFTER_S = 0.35, 0.25  # spans printed around each rollover's start (--trace-before/-after)
CUDA = torch.cuda.is_available()
# --memory-push K: the caching allocator's cudaMalloc/cudaFree calls from the run's start (its warm-up)
# through push K (counted from 0), each with its stream and where in our code it was asked for.
MEMORY_PUSH: dict = {"index": None, "starts": []}  # starts: device calls before each push
MEMORY_HISTORY_ENTRIES = 2_000_000
# --profile-push K[,K...]: torch.profiler around each of those pushes (the profiler's own start
# lengthens them), then their operators by device time; --host-profile-push: cProfile instead, then
# their Python calls by cumulative time.
PROFILED: dict = {"pushes": set(), "profiles": [], "host": False}
PROFILE_ROWS = 25
SLOW_CALL_S = 0.0005  # CUDA calls around the steps this long or longer get a span of their own


def timed(owner, name: str, label: str | None = None, device: bool = False) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not PHASE["product"]:
            return original(*args, **kwargs)
        thread = threading.current_thread().name
        what = label or name
        if name == "_estimate_transform":  # how many shared frames had their ratios made beforehand
            what = f"{what} ({len(args[0].early_ratios)} of {len(args[1])} ratios ahead)"
        if name == "_roll_over":
            ROLLOVERS.append(time.perf_counter())
        if name == "push" and owner is ChunkedEngine:
            PUSHES.append(time.perf_counter())
            before = device_mallocs()
            # Where push K+1 begins ends push K's calls; counted, since a snapshot here would cost 0.3-0.6 s.
            if CUDA and MEMORY_PUSH["index"] is not None and len(PUSHES) - 2 <= MEMORY_PUSH["index"]:
                MEMORY_PUSH["starts"].append(sum(before))
        if device and CUDA:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        profiled = name == "push" and owner is ChunkedEngine and len(PUSHES) - 1 in PROFILED["pushes"]
        with profiler(PROFILED["host"]) if profiled else contextlib.nullcontext() as profile:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if profiled:  # read after the profile ends, in the report
                    PROFILED["profiles"].append((len(PUSHES) - 1, profile))
                    if CUDA:
                        torch.cuda.synchronize()
                record_span(owner, name, what, thread, start, before if name == "push" else None)
                if device and CUDA:
                    end.record()
                    DEVICE.append((what, thread, begin, end))

    setattr(owner, name, wrapper)


def record_span(owner, name: str, what: str, thread: str, start: float, before) -> None:
    if name == "push" and owner is ChunkedEngine:
        what = f"{what}{malloc_note(before, device_mallocs())}"
    SPANS.append((what, thread, start, time.perf_counter()))


def profiler(host: bool):
    """cProfile for the host's Python calls (--host-profile-push), else torch.profiler's operators."""
    if host:
        return cProfile.Profile()
    activities = [torch.profiler.ProfilerActivity.CPU]
    return torch.profiler.profile(activities=activities + [torch.profiler.ProfilerActivity.CUDA] if CUDA else activities)


def device_mallocs() -> tuple[int, int]:
    """cudaMalloc and cudaFree calls of the caching allocator so far, all threads together."""
    if not CUDA:
        return 0, 0
    stats = torch.cuda.memory_stats()
    return stats.get("num_device_alloc", 0), stats.get("num_device_free", 0)


def malloc_note(before: tuple[int, int], after: tuple[int, int]) -> str:
    allocs, frees = after[0] - before[0], after[1] - before[1]
    return f" [cudaMalloc {allocs}, cudaFree {frees} meanwhile]" if allocs or frees else ""


def timed_if_slow(owner, name: str, label: str) -> None:
    """A span for each call of owner.name that takes SLOW_CALL_S or more, with the calling thread's CPU
    time in it: a CUDA call that waits on a lock (or for the interpreter) shows little CPU."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if not PHASE["product"]:
            return original(*args, **kwargs)
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            end = time.perf_counter()
            if end - start >= SLOW_CALL_S:
                used = 1000 * (time.thread_time() - cpu)
                SPANS.append((f"{label} (slow call, {used:.1f} ms CPU)", threading.current_thread().name, start, end))

    setattr(owner, name, wrapper)


def install() -> None:
    if CUDA:  # the CUDA calls a push makes around its steps, where one may wait for the driver
        timed_if_slow(torch.cuda.Event, "record", "cuda: event record")
        timed_if_slow(torch.cuda.Stream, "wait_event", "cuda: wait event")
        timed_if_slow(torch.cuda.Stream, "wait_stream", "cuda: wait stream")
        timed_if_slow(torch.cuda.StreamContext, "__exit__", "cuda: stream context exit")
        timed_if_slow(torch.cuda.StreamContext, "__enter__", "cuda: stream context enter")
    timed(ChunkedEngine, "_roll_over", "rollover")
    timed(chunks.ChunkAlignment, "_estimate_transform", "align: estimate")
    timed(chunks, "estimate_chunk_alignment", "align: sim3")
    timed(similarity, "median_ratio_scale", "align: median")
    timed(chunks, "aligned", "align: apply")
    timed(chunks.ChunkAlignment, "receive", "receive")
    timed(SpareEngine, "collect", "spare collect")
    timed(rollover.Rollover, "push_beside", "beside the spare")
    timed(ChunkedEngine, "_switch_to_spare", "switch")
    timed(ChunkedEngine, "push", "push")
    timed(rollover.Rollover, "take_ready", "take ready")
    timed(SpareEngine, "take_next", "spare take next")
    timed(SpareEngine, "hand_over", "spare hand over", device=True)
    timed(StreamingEngine, "push_checked", "step", device=True)
    timed(StreamingEngine, "_run_scale_frames", "scale step", device=True)
    timed(rollover.Rollover, "pace", "pace")
    timed(StreamingEngine, "push", "step", device=True)
    timed(StreamingEngine, "finish", "finish", device=True)
    timed(streaming.Run, "_emit", "sinks")
    real_run = pipeline.run_sequence

    def product(*args, **kwargs):
        PHASE["product"] = True
        if CUDA and MEMORY_PUSH["index"] is not None:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
            MEMORY_PUSH["recorded_from"] = sum(device_mallocs())
        base = torch.cuda.Event(enable_timing=True) if CUDA else None
        if CUDA:
            base.record()
        base_time = time.perf_counter()
        try:
            return real_run(*args, **kwargs)
        finally:
            PHASE["product"] = False
            if CUDA:
                torch.cuda.synchronize()
            report(base, base_time)

    pipeline.run_sequence = product


def report(base: torch.cuda.Event, base_time: float) -> None:
    # Device times as perf_counter seconds: the base event was recorded (and the GPU idle) at base_time.
    device = [] if base is None else [(what, thread, base_time + base.elapsed_time(b) / 1000, base_time + base.elapsed_time(e) / 1000)
              for what, thread, b, e in DEVICE]
    rows = [(s, e, f"{thread[:14]:<14} {what}") for what, thread, s, e in SPANS]
    rows += [(s, e, f"{thread[:14]:<14} [gpu] {what}") for what, thread, s, e in device]
    rows.sort()
    for number, at in enumerate(ROLLOVERS):
        print(f"== rollover {number} (ms from its start; host spans, then [gpu] device spans)")
        print_window(rows, at, at - TRACE_BEFORE_S, at + TRACE_AFTER_S)
    gaps = sorted(((later - earlier, index) for index, (earlier, later) in enumerate(zip(PUSHES[:-1], PUSHES[1:], strict=True))),
                  reverse=True)
    print_memory_push()
    print_profiles()
    for gap, index in gaps[:LONGEST]:
        at = PUSHES[index]
        print(f"== {1000 * gap:.1f} ms from push {index} to the next (ms from its start)")
        print_window(rows, at, at - 0.03, PUSHES[index + 1] + 0.005)


def print_memory_push() -> None:
    if MEMORY_PUSH["index"] is None:
        return
    events = torch.cuda.memory._snapshot()["device_traces"][0] if CUDA else []  # (taken after the run: it costs 0.3-0.6 s)
    starts = MEMORY_PUSH["starts"]
    print(f"== the caching allocator's device calls from the run's start through push {MEMORY_PUSH['index']}"
          + (" (its history overflowed: the first are lost)" if len(events) >= MEMORY_HISTORY_ENTRIES else ""))
    # The n-th cudaMalloc/cudaFree since the recording began is the allocator's device call number
    # recorded_from + n; each push began at a known call number (`starts`).
    calls = MEMORY_PUSH.get("recorded_from", 0)
    for event in events:
        if event["action"] not in ("segment_alloc", "segment_free", "segment_map", "segment_unmap"):
            continue
        push = bisect.bisect_right(starts, calls) - 1
        calls += event["action"] in ("segment_alloc", "segment_free")
        if push > MEMORY_PUSH["index"]:
            break
        when = f"push {push}" if push >= 0 else "before the pushes"
        ours = [f"{Path(frame['filename']).parent.name}/{Path(frame['filename']).name}:{frame['line']} {frame['name']}"
                for frame in event.get("frames", []) if "stream_recon" in frame["filename"]
                or any(f"/{room}/" in frame["filename"] for room in ("models", "cache", "app"))]
        print(f"   {when:>17}  {event['action']} {event['size'] / 2**20:8.1f} MiB on stream {event['stream']:#x}: "
              f"{' < '.join(ours[:3]) or '(no frame of ours)'}")


def print_profiles() -> None:
    for index, profile in PROFILED["profiles"]:
        if PROFILED["host"]:
            print(f"== push {index} under cProfile, its Python calls by cumulative time")
            pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative").print_stats(PROFILE_ROWS)
            continue
        print(f"== push {index} under torch.profiler, its operators by {'device' if CUDA else 'CPU'} time")
        print(profile.key_averages().table(sort_by="device_time_total" if CUDA else "cpu_time_total",
                                           row_limit=PROFILE_ROWS))


def print_window(rows: list[tuple[float, float, str]], at: float, first: float, last: float) -> None:
    for start, end, label in rows:
        if start < last and end > first:  # (a span begun before the window, a spare's scale step say, too)
            print(f"   {1000 * (start - at):8.1f} {1000 * (end - at):8.1f} {1000 * (end - start):7.1f}  {label}")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if {"-h", "--help"} & set(arguments):  # this script's own options; bench_e2e's parser prints the rest
        print(__doc__)
    if "--longest" in arguments:
        at = arguments.index("--longest")
        LONGEST = int(arguments[at + 1])
        del arguments[at : at + 2]
    for option in ("--profile-push", "--host-profile-push"):
        if option in arguments:
            at = arguments.index(option)
            PROFILED["pushes"], PROFILED["host"] = {int(i) for i in arguments[at + 1].split(",")}, option.startswith("--host")
            del arguments[at : at + 2]
    if "--memory-push" in arguments:
        at = arguments.index("--memory-push")
        MEMORY_PUSH["index"] = int(arguments[at + 1])
        del arguments[at : at + 2]
    for option in ("--trace-before", "--trace-after"):
        if option in arguments:
            at = arguments.index(option)
            globals()[f"TRACE_{option[8:].upper()}_S"] = float(arguments[at + 1])
            del arguments[at : at + 2]
    for option, module, constant, kind in (("--pace", rollover, "PACE", float),
                                           ("--main-priority", rollover, "MAIN_STREAM_PRIORITY", int),
                                           ("--spare-sm-share", lookahead, "SPARE_SM_SHARE", float)):
        if option in arguments:  # the module's constant, for this run
            at = arguments.index(option)
            setattr(module, constant, kind(arguments[at + 1]))
            del arguments[at : at + 2]
    install()
    sys.argv = ["bench_e2e.py", *arguments]
    bench_e2e.main()
