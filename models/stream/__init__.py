"""The stream: frames in, final per-frame predictions out, chunk after chunk.

Owns the streaming engine (engine) and its settings (stream_config), the keyframe policies
(keyframe_policy, and keyframes/: a file each, the folder their table), how one step runs on the device
(steps, graphs, staging), what it hands downstream (prediction) and the pose encoding those predictions
carry (pose), the memory plan of a run (memory), chunked streaming (chunked, chunks, similarity: Sim(3)
and chunk alignment), the rollover beside the stream (rollover, lookahead, spare_room: the device
memory a spare may take, sm_partition: the spare's share of the SMs). What is built for it (compiled code, kernels, graphs) is decided above it, in
builds/: the engine is handed a dry-pass context for its warm-up and told how to step.

May import: network, the shared modules at models/'s top (errors, supervision, daemon_pool)
and stream_recon.cache.
Imports nothing of: builds, loops, app.
"""
