"""The one base class for errors a user can act on: the CLI prints them as one line and exits 1."""


class DtrainError(RuntimeError):
    """A run cannot go on as asked; the message says why and what to do."""


class CheckpointError(DtrainError):
    """A checkpoint is missing or does not match this run."""
