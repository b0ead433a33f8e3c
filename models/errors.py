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
