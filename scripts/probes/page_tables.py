"""The paged cache's host work per streaming step, and how it grows with the window and the chunk.

    python3 scripts/probes/page_tables.py                     # the product's window and chunk, 10x and 100x
    python3 scripts/probes/page_tables.py --json pages.json

A step's bookkeeping is pure Python between two replays of the step's CUDA graph: the pending frame's append
(deferred eviction), the plan's input (the visible pages, their runs, the run table the range kernel reads)
and the keyframe decision's commit or rollback. This times them on the CPU over a stream of flow-like
decisions (keep 40 %), at the product's sizes (518x392: 1,036 patches a page, scale 8, window 64, chunks of
320 frames) and with the window and the chunk 10 and 100 times larger, and counts the runs a step reads.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from stream_recon.cache import CacheLayout, PagedTwoStreamCache, PagePool
from stream_recon.cache.triton_attention import run_table


def measure(window: int, chunk: int, steps: int, seed: int) -> dict:
    layout = CacheLayout(patches_per_frame=1036, specials_per_frame=6, scale_frames=8, window_frames=window)
    limit = PagedTwoStreamCache.pages_needed(layout, chunk + 1)
    cache = PagedTwoStreamCache(layout, PagePool(limit, max_pages=limit))
    generator = random.Random(seed)
    for _ in range(8):
        cache.append()
    cache.commit()
    while cache.num_committed_frames < min(chunk, 8 + window + 1):  # a full window first
        cache.append()
        cache.commit()
    times, runs = [], []
    for _ in range(steps):
        if cache.num_committed_frames >= chunk:  # a rollover: a fresh chunk of the same pool
            cache.reset()
            for _ in range(8):
                cache.append()
            cache.commit()
        started = time.perf_counter()
        cache.append(defer_eviction=True)
        visible = cache.visible_pages()
        table = run_table(visible.runs(), limit)
        (cache.commit if generator.random() < 0.4 else cache.rollback)()
        times.append(time.perf_counter() - started)
        runs.append(table[0])
    return {"window": window, "chunk": chunk, "pages": limit, "steps": steps,
            "median_us": 1e6 * statistics.median(times), "p99_us": 1e6 * sorted(times)[int(0.99 * len(times))],
            "runs_median": statistics.median(runs), "runs_max": max(runs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = [measure(window, chunk, args.steps, seed=window) for window, chunk in ((64, 320), (640, 3200),
                                                                                   (6400, 32000))]
    print(f"{'window':>7} {'chunk':>6} {'pages':>6} {'median us':>10} {'p99 us':>8} {'runs':>5} {'most':>5}")
    for row in rows:
        print(f"{row['window']:>7} {row['chunk']:>6} {row['pages']:>6} {row['median_us']:>10.1f} {row['p99_us']:>8.1f} "
              f"{row['runs_median']:>5.0f} {row['runs_max']:>5}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
