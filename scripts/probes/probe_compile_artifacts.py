"""What loading torch.compile's ahead-of-time artefacts saves against compiling where first called.

Records the arguments of every compiled method's calls in one eager streaming step (synthetic
weights, bf16, CUDA), then per distinct call: `--phase first` compiles it the usual way (timed,
cold or warm on-disk caches) and ahead of time (`aot_compile`, saved under --dir); `--phase second`
(a new process) compiles the usual way again (warm caches) and loads the saved artefacts (timed),
comparing each output with the eager method's.

    python scripts/probes/probe_compile_artifacts.py --phase first --dir /tmp/aot
    python scripts/probes/probe_compile_artifacts.py --phase second --dir /tmp/aot
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: bench.py
from bench import build_model  # noqa: E402

from stream_recon.models import StreamConfig, StreamingEngine, prepare_for_inference  # noqa: E402

METHODS = {"Block": ("attention_inputs", "attention_outputs"), "DPTHead": ("decode",),
           "CameraHead": ("condition", "refine")}


def signature(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{str(value.dtype)[6:]}{'c' if value.is_contiguous() else 'n'}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(signature(v) for v in value) + "]"
    if value is None:
        return "None"
    return type(value).__name__


def detach(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, list):
        return [detach(v) for v in value]
    if isinstance(value, tuple):
        return tuple(detach(v) for v in value)
    return value


def record_calls(model) -> dict:
    calls = {}  # (kind, method, signature) -> (module, args)
    for name, module in model.named_modules():
        kind = type(module).__name__
        for method in METHODS.get(kind, ()):
            original = getattr(module, method)
            key_kind = re.sub(r"\.\d+", "", name)

            def wrapped(*args, _original=original, _module=module, _kind=key_kind, _method=method):
                key = (_kind, _method, signature(args))
                if key not in calls:
                    calls[key] = (_module, detach(args))
                return _original(*args)

            setattr(module, method, wrapped)
    return calls


def flat(value):
    if isinstance(value, torch.Tensor):
        return [value.float()]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flat(v)]
    return []


def max_diff(a, b) -> float:
    return max((float((x - y).abs().max()) for x, y in zip(flat(a), flat(b), strict=True)), default=0.0)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("first", "second"), required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--height", type=int, default=392)
    parser.add_argument("--width", type=int, default=518)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--preset", default="lingbot-map-long")
    parser.add_argument("--limit", type=int, default=None, help="probe only the first N calls")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    loaded, _ = build_model(args.preset)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = prepare_for_inference(loaded, args.device, dtype, compile=False)
    calls = record_calls(model)
    engine = StreamingEngine(model, StreamConfig(cuda_graphs=False, pipeline=False))
    for _ in range(9):  # scale frames, then one streaming frame
        engine.push(torch.rand(3, args.height, args.width, device=args.device))
    engine.finish()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    streaming = {k: v for k, v in calls.items() if "T(1," in k[2] or k[1] in ("decode", "condition", "refine")}
    print(f"{len(calls)} distinct calls, {len(streaming)} kept", flush=True)
    rows = []
    for index, ((kind, method, sig), (module, call_args)) in enumerate(sorted(streaming.items(), key=lambda kv: kv[0])[:args.limit]):
        unbound = getattr(type(module), method)
        row = {"kind": kind, "method": method, "signature": sig[:80]}
        with torch.inference_mode(), torch.autocast(args.device, dtype, enabled=args.device == "cuda"):
            expected = unbound(module, *call_args)
            torch._dynamo.reset()
            start = time.perf_counter()
            usual = torch.compile(unbound, dynamic=False)(module, *call_args)
            sync()
            row["usual_compile_s"] = round(time.perf_counter() - start, 3)
            row["usual_diff"] = max_diff(usual, expected)
            path = args.dir / f"{index}.pt"
            try:
                if args.phase == "first":
                    start = time.perf_counter()
                    with torch._dynamo.config.patch(enable_aot_compile=True):  # (off by default in torch 2.11)
                        function = torch.compile(unbound, fullgraph=True, dynamic=False)
                    compiled = function.aot_compile(((module, *call_args), {}))
                    row["aot_compile_s"] = round(time.perf_counter() - start, 3)
                    compiled.save_compiled_function(str(path))
                    row["artefact_kb"] = path.stat().st_size // 1024
                else:
                    start = time.perf_counter()
                    with open(path, "rb") as file:
                        compiled = torch.compiler.load_compiled_function(file)
                    row["aot_load_s"] = round(time.perf_counter() - start, 3)
                start = time.perf_counter()
                out = compiled(module, *call_args)
                sync()
                row["aot_first_call_s"] = round(time.perf_counter() - start, 3)
                row["aot_diff"] = max_diff(out, expected)
            except Exception as error:  # the probe reports what did not work
                row["aot_error"] = f"{type(error).__name__}: {str(error)[:400]}"
        print(json.dumps(row), flush=True)
        rows.append(row)
    for key in ("usual_compile_s", "aot_compile_s", "aot_load_s", "aot_first_call_s"):
        print(key, round(sum(r.get(key, 0.0) for r in rows), 2))


if __name__ == "__main__":
    main()
