"""The evaluation: a run measured against ground truth, and many sequences run and measured in a batch.

Owns the metrics (metrics: evo-equivalent ATE/RPE and depth errors, eval.json), the evaluation's defaults
(settings), dataset discovery (datasets) and batch runs (batch; which sequences it skips or redoes, batch_resume;
its summary files and columns, batch_summary).

May import: run, sources, outputs, the shared modules at app/'s top (options, stopping) and
stream_recon.models.
Imports nothing of: viewer, commands.
"""
