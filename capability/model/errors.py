"""Errors raised while turning files on disk into a ready model."""


class ModelLoadError(ValueError):
    """A model folder cannot be loaded: a file is missing, malformed or does not fit the model.

    The message always names the offending file, because the operator fixing it
    is looking at a folder, not at a stack trace.
    """
