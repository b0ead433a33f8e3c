"""A model made ready for streaming once, explicitly, where it is loaded (gpt-fast's loader).

`prepare_for_inference` returns a NEW model for one device and precision; the model it is given is
left exactly as it was, so one loaded checkpoint can serve a float32 and a bf16 engine in any
order. What preparing does, and why each step belongs here rather than in the engine:

- placement and precision: on CUDA in bf16/fp16 the transformer and the DPT head take the half
  precision; the camera head stays float32, as the reference computes it (in bf16 its pose error
  doubles);
- fusions that replace modules: the MLPs' GELU inside the first layer's cuBLASLt epilogue
  (fused_gelu.py), the camera head's large layers reading float16-stored weights with float32
  arithmetic (few_token_linear.py; needs triton);
- the DINO and frame blocks' attention through `attend_frame` where our range kernel runs (Ampere or
  newer, bf16/fp16; cache/triton_attention.py): SDPA while a frame's tiles fit one wave of the range
  kernel, the range kernel past it (at three programs per SM on 132 SMs, frames over 1,024 tokens);
- channels-last DPT convolutions (cuDNN's NHWC kernels);
- torch.compile of the blocks' halves and both heads' pure parts (CUDA), each call signature
  compiled once and kept under an artefact folder when one is given (models/builds/compilation.py).

The engine takes only prepared models (`inference_spec`), and refuses one prepared for another
device or precision, so nothing downstream ever converts a model it was handed.
"""

from __future__ import annotations

from pathlib import Path

import torch

from stream_recon.cache.backends import HALF_DTYPES, unavailable_reason
from stream_recon.cache.packages import importable

from ..network.config import ModelConfig
from ..network.fused_gelu import fuse_mlp_gelu
from ..network.gct import GCTStream
from ..network.layers import Attention, Block
from ..network.prepared import InferenceSpec, dtype_name
from .compilation import CompiledMethods, compiled_where_called


def prepare_for_inference(model: GCTStream, device: str | torch.device | None = None,
                          dtype: torch.dtype = torch.float32, *, compile: bool | None = None,
                          half_camera_weights: bool = True, artefacts: str | Path | None = None) -> GCTStream:
    """A new GCTStream ready to stream on `device` in `dtype`, sharing no module with `model`.

    device: None keeps the model's. dtype: float32 anywhere; bf16/fp16 on CUDA only. compile:
    None compiles on CUDA (the first frames then take longer, later ones less), never on the CPU.
    artefacts: a folder where the compiled code is kept, so that a later run of the same input size
    loads it instead of compiling (models/builds/compilation.py); None: compiled in memory, where called.
    half_camera_weights: on CUDA in bf16/fp16 with triton, store the camera head's large weights in
    float16 (its arithmetic stays float32). Weights that need no conversion are shared with
    `model` (no copy); nothing writes to them.
    """
    if getattr(model, "inference_spec", None) is not None:
        raise ValueError("this model is already prepared for inference; prepare the model as loaded "
                         "(a prepared model's weights may be rounded or fused)")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if device.type == "meta":
        raise ValueError("a model on the meta device has no weights to place: pass the device to prepare it for "
                         "(its weights are then zero, as prepare_without_weights makes them)")
    if dtype not in (torch.float32, *HALF_DTYPES):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    on_cuda = device.type == "cuda"
    if dtype in HALF_DTYPES and not on_cuda:
        raise ValueError(f"{dtype_name(dtype)} runs need a CUDA device (got {device}); use float32 on the CPU")
    half = dtype in HALF_DTYPES
    prepared = _placed_copy(model, device, dtype if half else torch.float32)
    half_camera = False
    if half:
        fuse_mlp_gelu(prepared.aggregator)
        if half_camera_weights and importable("triton"):
            # its module imports Triton, which the check above found
            from ..network.few_token_linear import store_weights_in_half

            half_camera = store_weights_in_half(prepared.camera_head) > 0
    if half and on_cuda and unavailable_reason("triton", device, dtype) is None:
        use_range_kernel_for_frames(prepared.aggregator)
    if on_cuda:
        # cuDNN's NHWC convolutions: the DPT head's inputs are channels-last views already.
        prepared.depth_head.to(memory_format=torch.channels_last)
    compiled = on_cuda if compile is None else (compile and on_cuda)
    prepared.compiled_methods = None
    compile_function = None
    if compiled:
        methods = CompiledMethods(artefacts, device) if artefacts is not None else None
        compile_blocks(prepared, methods)
        compile_depth_head(prepared, methods)
        compile_camera_head(prepared, methods)
        prepared.compiled_methods = methods
        # the caches' helpers compile with the model's kept artefacts where it has them
        compile_function = compiled_where_called if methods is None else methods.compile
    prepared.inference_spec = InferenceSpec(device, dtype, compiled, half_camera, compile_function)
    return prepared


def prepare_without_weights(config: ModelConfig, device: str | torch.device,
                            dtype: torch.dtype = torch.float32) -> GCTStream:
    """A model of `config` prepared as `prepare_for_inference` prepares a loaded one for `device` and
    `dtype` (uncompiled), but with zero weights, before any checkpoint is read: the same modules and
    the same shapes, strides and kernels in its steps. Its predictions mean nothing; it runs a step's
    code ahead of the real model (models/builds/ahead.py). Zero rather than uninitialised memory, so
    that nothing it computes depends on what the allocator last held."""
    with torch.device("meta"):
        skeleton = GCTStream(config)
    return prepare_for_inference(skeleton, device, dtype, compile=False)


def _placed_copy(model: GCTStream, device: torch.device, half_dtype: torch.dtype) -> GCTStream:
    """A new module tree with `model`'s weights on `device`: the transformer and the DPT head in
    `half_dtype`, the rest float32 (as loaded)."""
    with torch.device("meta"):
        prepared = GCTStream(model.config)
    in_half = ("aggregator.", "depth_head.")
    state = {
        name: _placed(value, device, half_dtype if name.startswith(in_half) else value.dtype)
        for name, value in model.state_dict().items()
    }
    prepared.load_state_dict(state, strict=True, assign=True)
    return prepared.eval().requires_grad_(False)


def _placed(value: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`value` on `device` in `dtype`; a meta tensor (no data) becomes zeros of its shape."""
    if value.is_meta:
        return torch.zeros(value.shape, device=device, dtype=dtype)
    return value.to(device=device, dtype=dtype)


def use_range_kernel_for_frames(module: torch.nn.Module) -> int:
    """The attention of every block under `module` that attends without a cache (DINO, frame
    blocks) through `attend_frame` (the range kernel: Ampere or newer).
    cuDNN's kernel, SDPA's choice, runs a frame's 64-query tiles 264 at a time on 132 SMs: from
    1,042 tokens on (518x392) a second wave takes each call from 16 to 30 us, where the range kernel
    at three programs per SM takes 23. Returns the number of modules changed."""
    # the range kernel's module imports Triton: only on CUDA, where it is
    from stream_recon.cache.triton_attention import attend_frame


    modules = [m for m in module.modules() if isinstance(m, Attention)]
    for attention in modules:
        attention.self_attention = attend_frame
    return len(modules)


# -- torch.compile ---------------------------------------------------------------------------------
def compile_blocks(model: torch.nn.Module, methods: CompiledMethods | None = None) -> int:
    """Fuse the two halves of every transformer block (around its attention) with TorchInductor.

    The blocks of one kind share one compiled graph (modules are inputs, not constants), and the
    attention call between the halves stays eager, so any cache backend still serves it.
    `methods`: compiled ahead of time and kept there (None: torch.compile where first called).
    Returns the number of blocks compiled.
    """

    dynamo = torch._dynamo.config
    # Block kinds x input shapes (scale frames, streaming frame) exceed the default of 8.
    dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    for block in blocks:
        _compile_methods(block, ("attention_inputs", "attention_outputs"), methods)
    return len(blocks)


def compile_depth_head(model: torch.nn.Module, methods: CompiledMethods | None = None) -> None:
    """Fuse the DPT head's convolutional part (`DPTHead.decode`) with TorchInductor.

    Its ~30 convolutions stay cuDNN's; the ReLUs, residual sums, bilinear resizes and UV additions
    between them (full-resolution float32 tensors) become a few fused kernels. At 518x378:
    3.0 ms eager, 1.5 ms compiled with channels-last weights.
    """
    _compile_methods(model.depth_head, ("decode",), methods)


def compile_camera_head(model: torch.nn.Module, methods: CompiledMethods | None = None) -> None:
    """Fuse the camera head's per-iteration conditioning and pose refinement (its trunk blocks are
    compiled by `compile_blocks`): fewer small kernels on the step's longest path, the camera head."""
    _compile_methods(model.camera_head, ("condition", "refine"), methods)


def _compile_methods(module: torch.nn.Module, names: tuple[str, ...], methods: CompiledMethods | None) -> None:
    """Replace each named method of `module` (a freshly prepared one) by its compiled version."""
    if methods is not None:
        methods.install(module, names)
        return
    for name in names:
        setattr(module, name, compiled_where_called(getattr(module, name)))
