"""The user-error exception: a setting or input the user can fix, reported in one line."""


class UserError(ValueError):
    """A refusal caused by what the user asked for; the message names the setting and the fix."""
