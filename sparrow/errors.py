"""User-facing errors.

Anything a user can cause (a bad file, an unsupported architecture, an over-long prompt, an
invalid option) raises SparrowError with a one-line message; the CLI prints it without a
traceback and the server maps it to a 4xx response.
"""


class SparrowError(Exception):
    """An error caused by input, reported to the user as one line."""


class ContextLengthError(SparrowError):
    """The prompt plus requested tokens does not fit in the context window."""
