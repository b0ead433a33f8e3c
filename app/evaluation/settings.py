"""The evaluation's defaults and eval.json's names, free of the libraries the evaluation itself imports:
`eval -h` and `batch -h` show the defaults, the eval command prints its tables by the names, and
app.evaluation.metrics applies both."""

# evo's --t_max_diff: TUM ground truth runs at 100 Hz, so a frame's pose is within 5 ms
DEFAULT_MAX_DIFF = 0.01
# Depth frames are not the RGB frames: TUM's cameras stamp them up to ~20 ms apart, which is why TUM's
# associate.py pairs RGB and depth within 0.02 s.
DEPTH_MAX_DIFF = 0.02

STATISTICS = ("rmse", "mean", "median", "std", "min", "max", "sse")  # what evo_ape / evo_rpe print
# The evo-equivalent error series in eval.json: (key prefix, unit suffix; "" for ground-truth length units).
ERROR_METRICS = (("ate", ""), ("rpe_trans", ""), ("rpe_rot", "deg"))
# eval.json's key for the open chain's metrics (rundir.TRAJECTORY_OPEN_TUM, the poses before loop closure
# corrected them), scored as the run's trajectory is; absent when the run has no open chain.
OPEN_CHAIN = "open_chain"


def statistic_key(metric: str, statistic: str, unit: str = "") -> str:
    """The eval.json key of one statistic: ate_rmse, rpe_rot_rmse_deg; an sse is in the squared unit."""
    if not unit:
        return f"{metric}_{statistic}"
    return f"{metric}_{statistic}_{unit}{'2' if statistic == 'sse' else ''}"
