"""The one exception type for mistakes a user can fix."""


class UserError(ValueError):
    """A mistake the user can fix (bad setting, missing file); shown as one line."""
