"""How much a spare's work on part of the SMs slows the stream's step, and how much slower the spare gets
(GPU machine).

    python3 scripts/probes/probe_sm_partition.py --sms 0,112,96,80 --json $OUT/sm_partition.json

Stand-ins of the model's work at 518x392 (1,042 tokens a frame, bf16, blocks of width 1024, 16 heads):
the stream's step is a CUDA graph of 24 frame blocks and 24 blocks attending to 16 cached frames, replayed
on a stream of priority -1; the spare's scale step is 8 frames eagerly, 24 frame blocks and 24 blocks
over all 8,336 tokens, and its streaming step the stream's graph, both on the spare's stream: a plain
stream of priority 0 (`--sms 0`), or one on N SMs (models/stream/sm_partition.py). For each: every part alone,
then the stream's step paced as a rollover paces it (a replay, then idle for 0.6x its time alone) while
the spare runs scale steps back to back, and again while it replays streaming steps back to back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
import torch.nn.functional as F

from stream_recon.models.stream.sm_partition import device_sm_count, partitioned_stream

WIDTH, HEADS, TOKENS, CACHED_FRAMES, SCALE_FRAMES = 1024, 16, 1042, 16, 8


def make_blocks(count: int, device) -> list[dict[str, torch.Tensor]]:
    def weight(rows, cols):
        return torch.randn(rows, cols, device=device, dtype=torch.bfloat16) * rows ** -0.5
    return [dict(qkv=weight(WIDTH, 3 * WIDTH), proj=weight(WIDTH, WIDTH), fc1=weight(WIDTH, 4 * WIDTH),
                 fc2=weight(4 * WIDTH, WIDTH)) for _ in range(count)]


def block(x: torch.Tensor, w: dict, keys: torch.Tensor | None = None, frames: int = 1) -> torch.Tensor:
    """x [frames * T, W]; attention within each frame, or over `keys` [K, 2W] (cached K and V) too."""
    h = F.layer_norm(x, (WIDTH,))
    q, k, v = (h @ w["qkv"]).view(frames, -1, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
    if keys is not None:
        cached = keys.view(1, -1, 2, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        k, v = torch.cat([cached[0], k], 2), torch.cat([cached[1], v], 2)
    a = F.scaled_dot_product_attention(q, k, v).permute(0, 2, 1, 3).reshape(x.shape)
    x = x + a @ w["proj"]
    return x + F.gelu(F.layer_norm(x, (WIDTH,)) @ w["fc1"]) @ w["fc2"]


def stream_step(x, blocks, keys):
    for i in range(24):
        x = block(x, blocks[2 * i])
        x = block(x, blocks[2 * i + 1], keys)
    return x


def scale_step(x, blocks):
    for i in range(24):
        x = block(x, blocks[2 * i], frames=SCALE_FRAMES)
        x = block(x, blocks[2 * i + 1], frames=1)  # all 8,336 tokens attend to each other
    return x


def timed(run, stream, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        stream.synchronize()
        started = time.perf_counter()
        with torch.cuda.stream(stream):
            run()
        stream.synchronize()
        out.append((time.perf_counter() - started) * 1e3)
    return out


def summary(ms: list[float]) -> dict:
    ordered = sorted(ms)
    return dict(median=round(statistics.median(ms), 2), p90=round(ordered[int(0.9 * (len(ms) - 1))], 2),
                max=round(ordered[-1], 2), n=len(ms))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sms", default="0,112,96,80")
    parser.add_argument("--paced", type=int, default=40)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device)}, {device_sm_count(device)} SMs")
    blocks = make_blocks(48, device)
    x = torch.randn(TOKENS, WIDTH, device=device, dtype=torch.bfloat16)
    keys = torch.randn(CACHED_FRAMES * TOKENS, 2 * WIDTH, device=device, dtype=torch.bfloat16)
    x8 = torch.randn(SCALE_FRAMES * TOKENS, WIDTH, device=device, dtype=torch.bfloat16)
    main_stream = torch.cuda.Stream(device, priority=-1)

    def captured(run, capture_stream):
        with torch.cuda.stream(capture_stream):
            for _ in range(2):
                run()
        capture_stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture_stream):
            run()
        return graph

    step_graph = captured(lambda: stream_step(x, blocks, keys), torch.cuda.Stream(device))
    results = {"step_alone": summary(timed(step_graph.replay, main_stream, 20))}
    alone = results["step_alone"]["median"]
    print("stream step alone", results["step_alone"])
    for sms in [int(s) for s in args.sms.split(",")]:
        spare = torch.cuda.Stream(device) if sms == 0 else partitioned_stream(device, sms)
        if spare is None:
            print(f"{sms} SMs: no partitioned stream")
            continue
        row = {}
        spare_graph = step_graph
        captured_on_spare = captured(lambda: stream_step(x, blocks, keys), spare) if sms else None
        row["scale_alone"] = summary(timed(lambda: scale_step(x8, blocks), spare, 5))
        row["spare_step_alone"] = summary(timed(spare_graph.replay, spare, 10))
        if captured_on_spare is not None:
            row["spare_step_captured_on_it_alone"] = summary(timed(captured_on_spare.replay, spare, 10))
        for load_name, load in (("scale", lambda: scale_step(x8, blocks)), ("steps", spare_graph.replay)):
            stop, done = threading.Event(), []

            def spare_loop(load=load, stop=stop, done=done, spare=spare):
                while not stop.is_set():
                    with torch.cuda.stream(spare):
                        load()
                    spare.synchronize()
                    done.append(time.perf_counter())

            worker = threading.Thread(target=spare_loop)
            worker.start()
            time.sleep(0.2)
            began = time.perf_counter()
            paced = []
            for _ in range(args.paced):
                paced += timed(step_graph.replay, main_stream, 1)
                time.sleep(0.6 * alone / 1e3)
            elapsed = time.perf_counter() - began
            stop.set()
            worker.join()
            spare_done = sum(began <= t <= began + elapsed for t in done)
            row[f"step_beside_{load_name}"] = summary(paced)
            row[f"spare_{load_name}_per_s"] = round(spare_done / elapsed, 2)
        results[str(sms)] = row
        print(sms or "plain", json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
