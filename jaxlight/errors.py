"""Errors shared by the trainer's modules."""


class MisconfigurationError(ValueError):
    """A Trainer argument or a module definition that cannot work, said before any work is done."""
