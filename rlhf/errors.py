"""Error types for mistakes a user can fix; the CLI prints them without a traceback."""


class RLHFError(Exception):
    """A problem with the user's input (config, data, model folder, reward function, checkpoint)."""


class ConfigError(RLHFError, ValueError):
    """An invalid job configuration; the message names the key and how to fix it."""
