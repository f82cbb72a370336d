"""Errors of the `python -m ckpt` commands, in a module that imports nothing.

`python -m ckpt` names every user error it reports in one line (`USER_ERRORS`) before it parses
the command line; the commands that raise these import torch and megatron (seconds), so the
classes live here, where naming them costs nothing. Their commands import them from here too.
"""


class ReshapeError(RuntimeError):
    """The checkpoint cannot be reshaped as asked (the message says why)."""


class ExportError(RuntimeError):
    """An export or import that cannot proceed (the message says why)."""
