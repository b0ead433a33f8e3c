"""What a run's start costs on a machine whose compile caches are empty, part by part.

One process: the model (random weights: what compiling costs does not depend on their values) prepared
for CUDA in bf16, compiled or not; a ChunkedEngine with the defaults warmed up on a frame of the given
size (ChunkedEngine.warm_up: the scale step, two streaming steps, the spare's warm-up); then
`--frames` frames through it, the mean time of the last `--timed` taken as the engine's steady
ms/frame. Prints one JSON line: the warm-up's parts, Dynamo's and Inductor's compile times by phase,
the graphs compiled, Inductor's compile threads, and the steady ms/frame. `--triton-builds` adds every
Triton kernel compiled in this process (Inductor's own are built in its worker processes) with its time
and thread, and those built once the stream ran. `--no-dry-builds` warms up without the dry pass that
lists our Triton kernels' builds and builds them side by side (models/builds/kernel_builds.py), to compare.

Point TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR at an empty folder to measure a fresh machine in a
machine that compiled before (`PARTS=cold bash scripts/device/measure.sh start` does).

    python3 scripts/probes/probe_cold_start.py --height 392 [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter

PROCESS_STARTED = time.perf_counter()

import torch  # noqa: E402


def compile_phases() -> dict[str, float]:
    """Seconds spent per compile phase (Dynamo's counters: tracing, AOT, Inductor, Triton)."""
    from torch._dynamo.utils import compilation_time_metrics

    return {name: round(sum(times), 3) for name, times in compilation_time_metrics.items() if sum(times) > 0.05}


def specialization(src) -> str:
    """What made this compile of a kernel its own: the arguments' attributes (divisibility by 16) and the
    constants (constexprs and arguments specialized to a value), by argument name."""
    names = getattr(getattr(src, "fn", None), "arg_names", None)
    if names is None:
        return ""

    def name(key) -> str:
        return ".".join(names[i] if depth == 0 else str(i) for depth, i in enumerate(key))

    attrs = ",".join(f"{name(k)}:{'/'.join(str(a[1]) for a in v)}" for k, v in sorted(src.attrs.items()))
    constants = ",".join(f"{name(k)}={v}" for k, v in sorted(src.constants.items()) if v is not None)
    return f"attrs[{attrs}] constants[{constants}]"


class TritonBuilds:
    """Every Triton compile of this process, through Triton's compilation listener (triton >= 3.4):
    kernel name, whether the on-disk cache held it, milliseconds, the thread and when it finished."""

    def __init__(self) -> None:
        self.builds: list[dict] = []

    def __call__(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        import threading

        self.builds.append({"kernel": metadata.get("name", "?"), "cache_hit": cache_hit,
                            "ms": round(times.total / 1000, 1), "thread": threading.current_thread().name,
                            "at_s": round(time.perf_counter() - PROCESS_STARTED, 2),
                            "stages_ms": {"ir": round(times.ir_initialization / 1000, 1),
                                          **{name: round(us / 1000, 1) for name, us in times.lowering_stages}},
                            "specialization": specialization(src)})

    def summary(self, longest: int = 20) -> dict:
        built = [b for b in self.builds if not b["cache_hit"]]
        return {"built": len(built), "built_ms": round(sum(b["ms"] for b in built), 1),
                "cache_hits": len(self.builds) - len(built), "by_thread": dict(Counter(b["thread"] for b in self.builds)),
                "longest": sorted(built, key=lambda b: -b["ms"])[:longest]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--height", type=int, default=392)
    parser.add_argument("--width", type=int, default=518)
    parser.add_argument("--model", default="lingbot-map")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--device", default="cuda", help="cuda (bf16), or cpu (float32: the probe's own check)")
    parser.add_argument("--frames", type=int, default=160)
    parser.add_argument("--timed", type=int, default=100)
    parser.add_argument("--triton-builds", action="store_true", help="list the Triton kernels this process compiles")
    parser.add_argument("--no-dry-builds", action="store_true",
                        help="the warm-up without its dry pass (each Triton kernel built on its first launch), to compare")
    parser.add_argument("--no-early-builds", action="store_true",
                        help="leave the range kernel's scheduler builds to the warm-up (a run starts them before its load)")
    parser.add_argument("--profile-warm-up", type=int, default=0, metavar="N",
                        help="run the warm-up under cProfile and print its N most expensive functions (cumulative)")
    args = parser.parse_args()
    builds = TritonBuilds()
    if args.triton_builds:
        from triton import knobs

        knobs.compilation.listener = builds
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    from stream_recon.models import ModelConfig, StreamConfig, prepare_for_inference
    from stream_recon.models.builds import kernel_builds
    from stream_recon.models.stream.chunked import ChunkedEngine

    if not args.no_early_builds and args.device == "cuda":  # as run_sequence does, before the model is made
        config = ModelConfig.from_name(args.model)
        kernel_builds.start_early_builds("cuda", torch.bfloat16, config.num_heads, config.head_dim)
    if args.no_dry_builds:
        kernel_builds.available = lambda: False  # the engine's check: no dry pass, as before it existed

    result = {"height": args.height, "compile": not args.no_compile,
              "compile_threads": inductor_config.compile_threads, "import_s": time.perf_counter() - PROCESS_STARTED}
    started = time.perf_counter()
    from stream_recon.models.builds.compile_child import random_model

    model = random_model(ModelConfig.from_name(args.model), "cpu")
    result["build_s"] = time.perf_counter() - started
    started = time.perf_counter()
    on_cuda = args.device == "cuda"
    model = prepare_for_inference(model, args.device, torch.bfloat16 if on_cuda else torch.float32,
                                  compile=not args.no_compile)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    sync()
    result["prepare_s"] = time.perf_counter() - started
    engine = ChunkedEngine(model, StreamConfig())
    generator = torch.Generator().manual_seed(0)
    frames = [torch.randint(0, 256, (3, args.height, args.width), dtype=torch.uint8, generator=generator)
              for _ in range(8)]
    started = time.perf_counter()
    if args.profile_warm_up:
        import cProfile
        import pstats

        with cProfile.Profile() as profile:
            result["warm_up"] = engine.warm_up(frames[0])
        pstats.Stats(profile, stream=sys.stderr).sort_stats("cumulative").print_stats(args.profile_warm_up)
    else:
        result["warm_up"] = engine.warm_up(frames[0])
    result["warm_up_s"] = time.perf_counter() - started
    result["first_streaming_step"] = engine.stats()["warm_up"]
    result["graphs_compiled"] = counters["stats"]["unique_graphs"]
    builds_before_stream = len(builds.builds)
    result["compile_phases_s"] = compile_phases()
    times = []
    for index in range(args.frames):
        pushed = time.perf_counter()
        engine.push(frames[index % len(frames)])
        times.append(time.perf_counter() - pushed)
    engine.finish()
    sync()
    engine.close()
    result["steady_ms"] = 1000 * sum(times[-args.timed:]) / args.timed
    result["longest_push_ms"] = 1000 * max(times)
    result["graphs_compiled_while_streaming"] = counters["stats"]["unique_graphs"] - result["graphs_compiled"]
    result["process_s"] = time.perf_counter() - PROCESS_STARTED
    if args.triton_builds:
        result["triton_builds"] = builds.summary()
        result["triton_builds_while_streaming"] = len(builds.builds) - builds_before_stream
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
