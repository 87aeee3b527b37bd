"""The errors a user can cause, as opposed to bugs: every command shows them as one line, no traceback.

Each names what was wrong (the file, row, key or setting) and what to do. :func:`diffusion.cli.run`
turns them into ``<command>: error: <message>`` and exit status 2; ``--debug`` (or
``DIFFUSION_DEBUG=1``) shows the traceback instead.
"""


class UserError(ValueError):
    """Something the user gave cannot be used as asked; the message says what and why."""


class ConfigError(UserError):
    """A configuration that cannot be trained: the message names the key and what would be valid."""


class InputError(UserError):
    """An input that cannot be read as asked: missing, unreadable, or lacking a named column."""


class ModelReferenceError(UserError):
    """A model reference that is neither a usable local directory nor a downloadable hub id."""


class OutputMismatchError(UserError):
    """A re-run into an existing output whose samples were made with other settings."""


class DatasetMismatchError(UserError):
    """The shards were converted for a different resolution or text encoder than the model needs."""


class KitError(UserError):
    """A model kit that cannot be written where asked (e.g. a folder holding files that are not a kit)."""


class DataIntegrityError(UserError):
    """Stored data that is not what its index recorded: a shard corrupt, truncated or missing, or a
    metadata file (index.json, dataset.json) that cannot be read. The message names the file.

    Raised in a DataLoader worker, torch re-raises it in the main process with the worker's traceback
    as its message; the one line it was raised with is kept.
    """

    def __init__(self, message: str = ""):
        if isinstance(message, str) and "\nOriginal Traceback" in message:
            message = message.rstrip().rsplit(f"{type(self).__name__}: ", 1)[-1]
        super().__init__(message)
