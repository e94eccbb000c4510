"""The one exception type the CLI raises for a bad flag combination."""


class CLIError(ValueError):
    """A flag combination the CLI rejects; the message names the flag to change and how."""
