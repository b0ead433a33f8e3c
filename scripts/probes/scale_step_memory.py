"""Where a product run's device memory goes at its scale steps: `scripts/bench_e2e.py` run as usual, with
a report of the memory plan's parts, each eager scale step's allocator peak above what the process held
before it, what the allocator reserved then (by pool: the CUDA graphs' private pools apart; by stream),
and, on running out of memory, the live blocks by the lines of ours that allocated them.

    python scripts/probes/scale_step_memory.py --report scale.txt -- --frames 400 --video-size 640x480 \
        --viewer --client --no-engine-run --gpu-memory 8GiB
    python scripts/probes/scale_step_memory.py --report scale.txt --uncapped -- ...   # the budget planned, not held

With --gpu-memory, bench_e2e holds the allocator to the budget less the CUDA context; --uncapped plans for
the budget but lets the allocator take what it wants, which shows the peaks an estimate must cover.
These reports set models/stream/memory.py's aggregator and graph-pool constants (docs/performance-log.md has the runs).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import runpy
import sys
import time

import torch

MIB = 2**20


class Report:
    def __init__(self, path: str):
        self.file = open(path, "w")  # noqa: SIM115 (open for the run's length)

    def say(self, text: str) -> None:
        self.file.write(text + "\n")
        self.file.flush()


def mib(values: dict) -> str:
    return json.dumps({str(key): round(value / MIB, 1) for key, value in values.items()})


def reserved_by_pool_and_stream() -> tuple[dict, dict]:
    """Bytes the allocator reserves and holds live, by (pool, "reserved" | "live"), and reserved by stream."""
    pools, streams = collections.Counter(), collections.Counter()
    for segment in torch.cuda.memory._snapshot()["segments"]:
        pool = segment.get("segment_pool_id")
        pools[f"{pool}|reserved"] += segment["total_size"]
        pools[f"{pool}|live"] += segment["allocated_size"]
        streams[segment.get("stream")] += segment["total_size"]
    return pools, streams


def ours(frame: dict) -> bool:
    return any(part in frame["filename"] for part in ("stream_recon", "/models/", "/cache/", "/app/"))


def live_blocks_by_place() -> collections.Counter:
    """Live bytes by the three innermost lines of ours in their allocation's Python stack."""
    places = collections.Counter()
    for segment in torch.cuda.memory._snapshot()["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                frames = [f for f in block.get("frames", []) if ours(f)][:3]
                place = " < ".join(f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}" for f in frames)
                places[place or "(no frame of ours)"] += block["size"]
    return places


def trace_scale_steps(report: Report) -> None:
    from stream_recon.models.stream import steps

    run_scale_frames = steps.EagerRunner.run_scale_frames

    def traced(self, images, time_index):
        torch.cuda.synchronize()
        pools, streams = reserved_by_pool_and_stream()
        report.say(f"before the scale step: by pool MiB {mib(pools)}; reserved by stream MiB {mib(streams)}")
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        staged = run_scale_frames(self, images, time_index)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        report.say(f"scale step {tuple(images.shape)}: allocated before {before / MIB:.1f} MiB, peak {peak / MIB:.1f}, "
                   f"above {(peak - before) / MIB:.1f}; reserved {torch.cuda.memory_reserved() / MIB:.1f}; "
                   f"{time.perf_counter() - started:.2f} s")
        return staged

    steps.EagerRunner.run_scale_frames = traced


def report_plans(report: Report) -> None:
    from stream_recon.models.stream import engine

    plan_memory = engine.plan_memory

    def reported(*args, **kwargs):
        plan = plan_memory(*args, **kwargs)
        report.say(f"plan: window {plan.window}, {plan.kv_cache} cache; estimate MiB {mib(plan.estimate.to_dict())}")
        return plan

    engine.plan_memory = reported


def report_out_of_memory(report: Report) -> None:
    reported = []

    def on_out_of_memory(device, asked, device_in_use, device_free):
        if reported:
            return
        reported.append(True)
        pools, streams = reserved_by_pool_and_stream()
        report.say(f"out of memory asking {asked / MIB:.1f} MiB, {device_in_use / MIB:.1f} MiB of the device in use "
                   f"(every process), {device_free / MIB:.1f} free; this process by pool MiB "
                   f"{mib(pools)}; reserved by stream MiB {mib(streams)}; live blocks by place:")
        for place, size in live_blocks_by_place().most_common(40):
            report.say(f"  {size / MIB:9.1f} MiB  {place}")

    torch._C._cuda_attach_out_of_memory_observer(on_out_of_memory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", required=True, help="the report's file")
    parser.add_argument("--uncapped", action="store_true", help="plan for --gpu-memory without holding the allocator to it")
    parser.add_argument("bench_e2e_args", nargs=argparse.REMAINDER, help="after --: scripts/bench_e2e.py's options")
    args = parser.parse_args()
    report = Report(args.report)
    # every block's Python stack from here on (blocks allocated before show no frame)
    torch.cuda.memory._record_memory_history(max_entries=1, context="alloc", stacks="python")
    if args.uncapped:
        from stream_recon.models.stream import memory

        memory.hold_to_card = lambda budget, device="cuda": report.say(f"allocator not held to {budget / 2**30:.2f} GiB")
    trace_scale_steps(report)
    report_plans(report)
    report_out_of_memory(report)
    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_e2e.py")  # scripts/
    sys.argv = [bench, *[a for a in args.bench_e2e_args if a != "--"]]
    runpy.run_path(bench, run_name="__main__")


if __name__ == "__main__":
    main()
