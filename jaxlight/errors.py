"""Errors shared by the trainer's modules.

Each is raised in one module and caught or matched in others (the loops, the
strategies, the tests), so it lives here rather than beside the code that
raises it; the old import paths (``jaxlight.data.BatchError``) keep working.
"""


class MisconfigurationError(ValueError):
    """A Trainer argument or a module definition that cannot work, said before any work is done."""


class BatchError(ValueError):
    """A batch the compiled step cannot take (shapes disagree, rows don't divide)."""
