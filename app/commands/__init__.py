"""The commands: one module per `stream-recon` command, thin, each calling the rooms that do its work.

May import: anything of the app (sources, run, outputs, evaluation, viewer and the shared modules at app/'s top)
and stream_recon.models.
Imports nothing of: stream_recon.cache.
"""
