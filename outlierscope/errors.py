"""The one exception type that the CLI turns into a one-line message and a non-zero exit."""


class OutlierscopeError(Exception):
    """A user-facing error: the message names the problem and the fix, on one line."""
