"""Where preparing a loaded checkpoint for a bf16 CUDA run spends its time, step by step.

Loads CHECKPOINT on the host as the app does, then runs prepare_for_inference's steps one at a time
(models/builds/prepare.py: placement and precision, the fused GELU, float16 camera weights, the range kernel
for frames, channels-last DPT weights, torch.compile's wrappers), each timed after a CUDA
synchronisation; prints one JSON line. The steps are the module's own functions, in its order.

    python3 scripts/probes/probe_prepare.py /tmp/ckpt/full-size.pt
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    from stream_recon.models import load_model
    from stream_recon.models.builds import prepare as steps
    from stream_recon.models.network.few_token_linear import store_weights_in_half
    from stream_recon.models.network.fused_gelu import fuse_mlp_gelu

    device = torch.device(args.device)
    seconds: dict[str, float] = {}

    def timed(name, call, *call_args):
        torch.cuda.synchronize()
        started = time.perf_counter()
        result = call(*call_args)
        torch.cuda.synchronize()
        seconds[name] = round(time.perf_counter() - started, 3)
        return result

    torch.cuda.init()
    loaded = timed("read_on_host", load_model, args.checkpoint, "cpu")
    state = timed("state_dict", loaded.state_dict)
    timed("touch_host_pages", lambda: [float(value.sum()) for value in state.values()])  # every page read once
    prepared = timed("placed_copy", steps._placed_copy, loaded, device, torch.bfloat16)
    timed("fuse_mlp_gelu", fuse_mlp_gelu, prepared.aggregator)
    timed("store_weights_in_half", store_weights_in_half, prepared.camera_head)
    timed("use_range_kernel_for_frames", steps.use_range_kernel_for_frames, prepared.aggregator)
    timed("channels_last", lambda: prepared.depth_head.to(memory_format=torch.channels_last))
    timed("import_compiler", lambda: (__import__("torch._dynamo"), __import__("torch._inductor.compile_fx")))
    timed("compile_blocks", steps.compile_blocks, prepared)
    timed("compile_depth_head", steps.compile_depth_head, prepared)
    timed("compile_camera_head", steps.compile_camera_head, prepared)
    seconds["total"] = round(sum(seconds.values()), 3)
    print(json.dumps(seconds))


if __name__ == "__main__":
    main()
