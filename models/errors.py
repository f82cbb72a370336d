"""Errors the model code raises for input the user can change, light to import (no torch): the
entry points turn them into one `error:` line."""


class AttentionTooLarge(ValueError):
    """An attention call the chosen path cannot run within its memory bound."""
