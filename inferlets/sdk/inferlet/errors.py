"""Errors an inferlet raises on purpose."""


class InferletError(Exception):
    """Raise this to end the run with just this message (no traceback) as its error."""
