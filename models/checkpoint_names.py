"""The official checkpoints' names and the one a run uses by default, in a module free of torch and
huggingface_hub: `stream-recon -h` shows them (hub_paths.py resolves and downloads them)."""

from __future__ import annotations

# name -> file in the Hugging Face repository (hub_paths.HF_REPO_ID)
KNOWN_CHECKPOINTS = {"lingbot-map-long": "lingbot-map-long.pt", "lingbot-map": "lingbot-map.pt"}
DEFAULT_CHECKPOINT = "lingbot-map-long"
# The size of each official checkpoint, as every message says it: 1.16 G float32 parameters (4.64e9 bytes)
CHECKPOINT_SIZE = "4.3 GiB"
