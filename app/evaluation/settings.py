"""The evaluation's defaults, free of the libraries the evaluation itself imports: `eval -h` and
`batch -h` show them, and app.evaluation.metrics applies them."""

# evo's --t_max_diff: TUM ground truth runs at 100 Hz, so a frame's pose is within 5 ms
DEFAULT_MAX_DIFF = 0.01
# Depth frames are not the RGB frames: TUM's cameras stamp them up to ~20 ms apart, which is why TUM's
# associate.py pairs RGB and depth within 0.02 s.
DEPTH_MAX_DIFF = 0.02
