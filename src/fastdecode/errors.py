"""Errors fastdecode raises for bad input.

Every error a user can cause derives from :class:`FastDecodeError`; the CLI
prints its message on one line and exits non-zero, with no traceback. Anything
else escaping is a bug in fastdecode.
"""


class FastDecodeError(Exception):
    """Base class for errors caused by the user's input or environment."""


class ModelLoadError(FastDecodeError):
    """A model spec that cannot be resolved or loaded (missing, corrupt, unsupported)."""


class ConfigError(FastDecodeError):
    """Nonsense settings: sampling parameters, draft length, dtype/device, ..."""


class PromptTooLongError(FastDecodeError):
    """The prompt alone fills the model's context window."""


class IncompatibleDrafterError(FastDecodeError):
    """A drafter that cannot serve this target (vocabulary mismatch, cache cannot roll back)."""
