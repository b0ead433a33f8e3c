"""Errors users can act on. Each message says what was wrong and what to do."""


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or does not match the model."""


class CheckpointUnavailable(CheckpointError):
    """A checkpoint that is not on this machine and cannot be fetched now: Hugging Face offline mode, or the
    hub unreachable. Nothing was written; the message names the file's URL and the folder to put it in."""


class FrameError(ValueError):
    """A frame cannot be fed to the stream (wrong type, shape or size)."""


class MemoryBudgetError(ValueError):
    """A run that no allowed setting fits into the GPU memory budget it was given."""


def checkpoint_advice(message: str) -> str:
    """A checkpoint error as the CLI gives it (a run's load, `convert`). The model's loader advises its Python arguments
    (`allow_partial=True`), which the CLI does not offer: that advice is replaced by what a user of the CLI
    can do. The first line stays the headline; the rest (the tensors by name) are details for --verbose."""
    lines = message.strip().splitlines()
    if not any("allow_partial" in line for line in lines):
        return message
    headline = lines[0].rstrip(".")
    details = [line for line in lines[1:] if "allow_partial" not in line]
    advice = ("; pass the checkpoint made for this model: a .pt file is read with the official configuration, "
              "a .safetensors file with the one it carries (`stream-recon convert` writes one)")
    return "\n".join([headline + advice, *details])
