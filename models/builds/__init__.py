"""The builds: what a run builds, when and where (plan: one table, one builder), and each stage's means.

Owns preparing a loaded model for one device and precision (prepare), torch.compile's output kept between
runs and the records of what this machine compiled (compilation), our Triton kernels' first builds, listed by
a dry pass and built side by side (kernel_builds), in child processes first on a machine whose Triton cache
holds none of ours (kernel_builders), the dry pass run while a checkpoint loads (ahead), a known size's
compiled code made beside the stream (while_streaming) and a new size's in a child for the next run
(compile_child). The builds' process-wide state is one object, kernel_builds.PROCESS.

Above the stream: it drives engines (a dry pass, a warm-up, the step mode), which import nothing of it.
May import: network, stream, the shared modules at models/'s top and stream_recon.cache.
Imports nothing of: loops, app.
"""
