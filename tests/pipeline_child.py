"""Child process for the interruption tests: one run of the tiny model on a video, then exit.

    python tests/pipeline_child.py VIDEO OUTPUT_DIR

Exit code: 0 complete, 1 failed, 130 interrupted (as the CLI), so the parent can assert on it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from stream_recon.app.pipeline import RunOptions, run_sequence
from stream_recon.models import GCTStream, ModelConfig

EXIT_CODES = {"complete": 0, "failed": 1, "interrupted": 130}


def main(video: str, output_dir: str) -> int:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the parent test runs beside other work on 2 cores
    model = GCTStream(ModelConfig.tiny()).eval()
    options = RunOptions(image_width=56, scale_frames=2, window=4, viewer=False)
    print("started", flush=True)
    summary = run_sequence(video, Path(output_dir), options, model=model)
    print(f"status={summary.status} frames={summary.frames}", flush=True)
    return EXIT_CODES[summary.status]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
