"""The one exception type the CLI turns into a clear message and exit code 2."""


class MemshardError(ValueError):
    """Bad input or an unsolvable request; the message is meant for the user as it is."""
