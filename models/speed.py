"""Speed-ups applied to a built model, never threaded through the modules (gpt-fast style).

`compile_static_parts` compiles the parts whose shapes are fixed for a whole stream: the DINO trunk's
blocks, the frame blocks, the MLP half of every global block and the DPT head. The global blocks'
attention (its key set grows and shrinks) and the camera head (its cache grows) stay eager.
"""

from __future__ import annotations

import torch

from .gct import GCTStream


def compile_static_parts(model: GCTStream, mode: str = "max-autotune-no-cudagraphs") -> GCTStream:
    aggregator = model.aggregator
    for blocks in (aggregator.patch_embed.blocks, aggregator.frame_blocks):
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, mode=mode, dynamic=False)
    for block in aggregator.global_blocks:
        block.mlp = torch.compile(block.mlp, mode=mode, dynamic=False)
    model.depth_head = torch.compile(model.depth_head, mode=mode, dynamic=False)
    return model
