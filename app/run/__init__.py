"""The run: one stream from source to sinks, and everything it holds while it streams.

Owns the pipeline (pipeline: the plan, the set-up and what follows the end; streaming: the loop over the
frames and how a run ends; finite_check: the first sink), loading the checkpoint and
building the engine (loading; what is built for it, when and where, is models/builds/plan.py's), the
loop-closure sink (loops), the frame clock and rates (clock), the progress line
(progress), the machine's resources before a CPU run (resources), the presets from configs/ (presets), and
query frames placed in a finished run's map, the model run on each (localise).

May import: sources, outputs, viewer, the shared modules at app/'s top (options, stopping) and
stream_recon.models.
Imports nothing of: evaluation, commands.
"""
