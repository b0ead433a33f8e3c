"""The builds: the network made ready to run on a device, and its compiled code and kernels built.

Owns preparing a loaded model for one device and precision (prepare: placement, fused modules, compiled
methods), torch.compile's output kept between runs and the records of what was compiled (compilation),
and our Triton kernels' first builds, listed by a dry step and built side by side (kernel_builds), in child
processes first on a machine whose Triton cache holds none of ours (kernel_builders).
Running a stream's dry pass ahead of its warm-up needs an engine, so it is the stream's
(stream/builds_ahead.py).

May import: network, the shared modules at models/'s top (supervision, daemon_pool, errors) and
stream_recon.cache.
Imports nothing of: stream, loops, app.
"""
