"""The error a user can cause and fix: one sentence that says what to change (the CLI exits with code 2)."""


class ConfigError(ValueError):
    """A user-caused configuration mistake, reported as one sentence."""
