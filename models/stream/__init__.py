"""The stream: frames in, final per-frame predictions out, chunk after chunk.

Owns the streaming engine (engine) and its settings (stream_config), how one step runs on the device
(steps, graphs, staging), what it hands downstream (prediction) and the pose encoding those predictions
carry (pose), the memory plan of a run (memory), chunked streaming (chunked, chunks, similarity: Sim(3)
and chunk alignment), the rollover beside the stream (rollover, lookahead, sm_partition: the spare's
share of the SMs), and the warm-up's dry pass run while a checkpoint loads (builds_ahead).

May import: network, builds, the shared modules at models/'s top (errors, supervision, daemon_pool)
and stream_recon.cache.
Imports nothing of: loops, app.
"""
