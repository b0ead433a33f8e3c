"""The network: the GCT model's modules and heads, pure torch code with no notion of a stream.

Owns the architecture's configuration (config), the building blocks (layers, rope), the DINO trunk
(dino), the aggregator, the camera head (camera_head) and the DPT depth head (dpt_head), the assembled
network (gct: GCTStream), the retrieval descriptor it makes from its own tokens (descriptor), and the
kernels that replace parts of it once prepared (qk_norm_rope, fused_gelu, few_token_linear; custom_ops
makes such a kernel a torch operator for compiled code only).

May import: stream_recon.cache (backend facts, packages, run_beside) and this room's own modules.
Imports nothing of: builds, stream, loops, app.
"""
