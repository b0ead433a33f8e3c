"""The outputs: what a run leaves on disk and what is made of it afterwards.

Owns the run directory (rundir: names, whether a folder holds a run, reading one back, run.json), how a file
is written (atomic_writes: a temp file and a rename; a folder's entries swapped as one), JSON records
(json_records: strict UTF-8), a run's claim on its folder (output_folder: the check and the lock), one npz read
(npz_reading), the TUM text files (trajectories), the per-frame npz schema (npz_schema), the writer sink (writers), the point cloud and its PLY (pointcloud), the exports (export: the
target, its staging and swap, the one pass over a run; export_images: the frames' images) and their formats
(formats/: a file each, the folder their table; export_job: what a format's file fills in and its writer is
handed), Gaussian splats (splats), and the pixels a frame drops (masks: the sky network of sky, a user's mask
folder).

May import: sources (a frame re-read for an export, its turn), the shared modules at app/'s top (options,
stopping) and stream_recon.models.
Imports nothing of: run, evaluation, viewer, commands.
"""
