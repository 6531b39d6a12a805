"""One error family for everything a user can cause.

A run stops on an `OPDError` with its message alone: one sentence naming the key, file or line
at fault, never a traceback. Anything else is a bug and keeps its traceback. The subclasses say
which input was wrong; each is also a `ValueError` (or `FileNotFoundError`) so that callers of
the library can catch the built-in kind they expect.
"""


class OPDError(Exception):
    """A user mistake or a run that cannot go on; the message names the key, file or line."""


class ConfigError(OPDError, ValueError):
    """A recipe, cluster file, override, plugin or command-line argument that cannot be used."""


class DatasetError(OPDError, ValueError):
    """A dataset file or line that cannot be used; the message names the file and line."""


class ChatTemplateError(OPDError, ValueError):
    """A chat template the rollout cannot render by appending."""


class VocabularyError(OPDError, ValueError):
    """Student, teacher and tokenizer cannot be compared token by token."""


class CheckpointError(OPDError, ValueError):
    """A checkpoint that cannot be resumed (damaged, of another world size, missing)."""


class ModelFileError(OPDError, ValueError):
    """A model directory whose config or weights cannot be read (damaged, partly copied)."""


class MissingFileError(OPDError, FileNotFoundError):
    """A path named by the config that does not exist."""


class NonFiniteError(OPDError):
    """Training stopped: steps had a non-finite loss or gradient norm (train.nonfinite)."""


class MetricsError(OPDError, ValueError):
    """A metrics file that cannot be read; the message names the file and line."""


class TeacherServerError(OPDError):
    """A served teacher that is down, hangs, answers too slowly or answers wrongly; the message
    names its URL (teacher.urls)."""
