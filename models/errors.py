"""Errors a user can cause. The CLI and UI print their message as one line, without a traceback."""


class QwenImageError(Exception):
    """Base class for problems with the user's input, checkpoint or environment."""


class InputError(QwenImageError, ValueError):
    """A generation argument is invalid (empty prompt, bad size, bad step count...); `field` names the
    request option it concerns (pipelines/options.py), set where the check is made (None: no one option,
    e.g. a combination), so each front end can name its own input (flag, JSON parameter, control)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class CheckpointError(QwenImageError):
    """A checkpoint directory is missing, incomplete, or fails validation."""


class ParallelError(QwenImageError):
    """A collective across the ranks failed or timed out: another rank died or stopped answering."""
