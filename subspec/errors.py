"""User-facing errors.

Every problem a user can cause (a bad path, a budget that is too small, an invalid sampling value) is raised
as :class:`SubspecError` with a one-line message that names the problem and the fix. The CLI prints it
without a traceback and exits with status 2; library users catch it like any exception.
"""


class SubspecError(Exception):
    """A problem with the user's input or environment, explained in one line (CLI exit code 2)."""
