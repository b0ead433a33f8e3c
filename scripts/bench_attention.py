"""Global-attention kernels over the streaming key set, one layer's shape, on the GPU.

    python scripts/bench_attention.py [--special-frames 200] [--json out.json]

Shape at 518x378 with scale 8 / window 64: 1005 queries, 16 heads x 64, keys = 72 patch frames x
999 + 6 specials per committed frame. Compares FlashInfer paged prefill (fa2 with one page per
frame; fa3 with power-of-two and token-level pages), PyTorch SDPA on the gathered pages, and
dense SDPA on contiguous keys (the ceiling). Prints ms per call and TFLOP/s.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def time_ms(fn, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def graph_time_us(calls, replays: int = 30) -> float:
    """Mean microseconds of one call when all `calls` are captured into one CUDA graph and replayed
    (after a warm-up on a side stream: kernel compilation, cuBLAS algorithm choice)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(calls))


def contiguous_candidates(q, keys, values, reference, workspace, groups: set[str]) -> dict:
    """Kernels that read the visible keys in place from one contiguous buffer per layer, where the
    visible set is the slot range [start, end) of a larger store (a compact cache layout)."""

    results = {}
    num_keys, heads, dim = keys.shape
    pad = 4096  # room below the visible range, as the downward-growing special tokens leave
    store_k = torch.zeros(num_keys + 2 * pad, heads, dim, dtype=keys.dtype, device=keys.device)
    store_v = torch.zeros_like(store_k)
    store_k[pad : pad + num_keys] = keys
    store_v[pad : pad + num_keys] = values
    cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([pad, pad + num_keys], dtype=torch.int32, device=q.device)

    def attempt(name, fn):
        try:
            out = fn()
            results[name] = time_ms(fn)
            results[name + "_maxerr"] = (out.float() - reference.float()).abs().max().item()
        except Exception as exc:  # report and go on
            results[name] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"

    def torch_flash_varlen():
        out = torch.ops.aten._flash_attention_forward(q, store_k, store_v, cu_q, cu_k, q.shape[0], store_k.shape[0],
                                                      0.0, False, False)
        return out[0]

    if "torch" in groups:
        torch_candidates(attempt, torch_flash_varlen, q, keys, values, cu_k, pad, results)
    if "flashinfer" in groups:
        flashinfer_candidates(attempt, q, keys, values, store_k, store_v, pad, cu_q, workspace, results)
    return results


def torch_candidates(attempt, torch_flash_varlen, q, keys, values, cu_k, pad, results) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    num_keys = keys.shape[0]
    attempt("torch_flash_varlen_offset", torch_flash_varlen)
    qc, kc, vc = (t.transpose(0, 1)[None].contiguous() for t in (q, keys, values))
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        def sdpa(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qc, kc, vc)[0].transpose(0, 1)
        attempt(f"sdpa_{backend.name.lower()}", sdpa)
    try:  # the varlen kernel inside a CUDA graph, with the visible range moved between replays
        graph = torch.cuda.CUDAGraph()
        torch_flash_varlen()
        with torch.cuda.graph(graph):
            captured = torch_flash_varlen()
        cu_k.copy_(torch.tensor([pad + 999, pad + num_keys], dtype=torch.int32, device=q.device))
        graph.replay()
        expected = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[999:].transpose(0, 1)[None],
                                                  values[999:].transpose(0, 1)[None])[0].transpose(0, 1)
        results["torch_flash_varlen_graph_replay_maxerr"] = (captured.float() - expected.float()).abs().max().item()
        results["torch_flash_varlen_graph"] = time_ms(graph.replay)
    except Exception as exc:
        results["torch_flash_varlen_graph"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"


def flashinfer_candidates(attempt, q, keys, values, store_k, store_v, pad, cu_q, workspace, results) -> None:
    import flashinfer

    num_keys, heads, dim = keys.shape
    for variant in ("fa2", "fa3"):
        attempt(f"flashinfer_single_{variant}",
                lambda variant=variant: flashinfer.single_prefill_with_kv_cache(q, keys, values, causal=False, backend=variant))
        try:
            ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout="NHD", backend=variant)
            ragged.plan(cu_q, torch.tensor([0, num_keys], dtype=torch.int32, device=q.device), heads, heads, dim,
                        causal=False, q_data_type=q.dtype, kv_data_type=q.dtype)
            view_k, view_v = store_k[pad : pad + num_keys], store_v[pad : pad + num_keys]
            attempt(f"flashinfer_ragged_{variant}", lambda ragged=ragged, vk=view_k, vv=view_v: ragged.run(q, vk, vv))
        except Exception as exc:
            results[f"flashinfer_ragged_{variant}"] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
    fp8 = torch.float8_e4m3fn
    q8, k8, v8 = q.to(fp8), keys.to(fp8), values.to(fp8)
    attempt("flashinfer_single_fa3_fp8",
            lambda: flashinfer.single_prefill_with_kv_cache(q8, k8, v8, causal=False, backend="fa3", o_dtype=torch.bfloat16))
    attempt("flashinfer_single_fa3_fp8kv_bf16q",
            lambda: flashinfer.single_prefill_with_kv_cache(q, k8, v8, causal=False, backend="fa3"))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--patches", type=int, default=999)
    parser.add_argument("--patch-frames", type=int, default=72)
    parser.add_argument("--special-frames", type=int, default=200)
    parser.add_argument("--groups", default="paged,torch,flashinfer",
                        help="comma list: paged (FlashInfer on pages), torch and flashinfer (contiguous keys)")
    parser.add_argument("--json")
    args = parser.parse_args()
    groups = set(args.groups.split(","))
    import flashinfer

    heads, dim, dtype, dev = 16, 64, torch.bfloat16, "cuda"
    queries = args.patches + 6
    num_keys = args.patch_frames * args.patches + 6 * args.special_frames
    flops = 4 * queries * num_keys * heads * dim
    q = torch.randn(queries, heads, dim, dtype=dtype, device=dev)
    keys = torch.randn(num_keys, heads, dim, dtype=dtype, device=dev)
    values = torch.randn(num_keys, heads, dim, dtype=dtype, device=dev)
    results = {}

    def dense():
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None])

    qc, kc, vc = (t.transpose(0, 1)[None].contiguous() for t in (q, keys, values))
    results["sdpa_dense_contiguous"] = time_ms(lambda: F.scaled_dot_product_attention(qc, kc, vc))
    results["sdpa_dense_strided"] = time_ms(dense)
    workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=dev)

    def paged(page_size: int, backend: str):
        num_pages = -(-num_keys // page_size)
        cache = torch.zeros(num_pages + 1, 2, page_size, heads, dim, dtype=dtype, device=dev)
        flat = cache[:num_pages].reshape(num_pages, 2, page_size, heads, dim)
        padded = torch.zeros(num_pages * page_size, heads, dim, dtype=dtype, device=dev)
        padded[:num_keys] = keys
        flat[:, 0] = padded.view(num_pages, page_size, heads, dim)
        padded[:num_keys] = values
        flat[:, 1] = padded.view(num_pages, page_size, heads, dim)
        perm = torch.randperm(num_pages, device=dev).int()  # pages scattered, as in the real pool
        cache_scattered = torch.empty_like(cache)
        cache_scattered[perm.long()] = cache[:num_pages]
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD", backend=backend)
        last = num_keys - (num_pages - 1) * page_size
        wrapper.plan(torch.tensor([0, queries], dtype=torch.int32, device=dev),
                     torch.tensor([0, num_pages], dtype=torch.int32, device=dev), perm,
                     torch.tensor([last], dtype=torch.int32, device=dev), heads, heads, dim, page_size,
                     causal=False, pos_encoding_mode="NONE", q_data_type=dtype, kv_data_type=dtype)
        out = wrapper.run(q, cache_scattered)
        reference = dense()[0].transpose(0, 1)
        error = (out.float() - reference.float()).abs().max().item()
        return time_ms(lambda: wrapper.run(q, cache_scattered)), error

    for page_size, backend in [] if "paged" not in groups else [(args.patches, "fa2"), (1, "fa2"), (16, "fa2"), (1, "fa3"), (16, "fa3"), (64, "fa3"), (1024, "fa3")]:
        try:
            ms, error = paged(page_size, backend)
            results[f"flashinfer_{backend}_page{page_size}"] = ms
            results[f"flashinfer_{backend}_page{page_size}_maxerr"] = error
        except Exception as exc:  # report and go on: one variant failing must not hide the others
            results[f"flashinfer_{backend}_page{page_size}"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"

    page_ids = torch.randperm(args.patch_frames, device=dev)
    pages = torch.randn(args.patch_frames, 2, args.patches, heads, dim, dtype=dtype, device=dev)

    def gather_then_sdpa():
        g = pages.index_select(0, page_ids)
        k = g[:, 0].reshape(-1, heads, dim)
        v = g[:, 1].reshape(-1, heads, dim)
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None])

    results["gather_then_sdpa_patch_only"] = time_ms(gather_then_sdpa)
    results.update(contiguous_candidates(q, keys, values, dense()[0].transpose(0, 1), workspace, groups))
    print(f"keys {num_keys}, queries {queries}, {flops / 1e12:.3f} TFLOP per call")
    for name, value in results.items():
        if isinstance(value, float) and not name.endswith("maxerr"):
            print(f"{name:>36}: {value:7.3f} ms  {flops / value / 1e9:6.1f} TFLOP/s")
        else:
            print(f"{name:>36}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"num_keys": num_keys, "queries": queries, "tflop": flops / 1e12, **results}, f, indent=1)


if __name__ == "__main__":
    main()
