"""The application: the `stream-recon` command line and what a run, an export, an evaluation or a view does.

Rooms (each package's docstring says what it holds and what it may import; tests/test_import_directions.py
checks): commands (one module per command), sources (frames in), run (one stream, source to sinks), outputs
(the run directory and what is made of it), evaluation (metrics, datasets, batch) and viewer (live and
replay). Shared at the top: cli (the root command), options (RunOptions and the app's own defaults) and
stopping (signals in each phase of a command).
"""
