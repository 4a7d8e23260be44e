"""Exceptions raised by otel-train."""


class ConfigError(ValueError):
    """Bad settings or an environment that cannot be traced; raised by ``init`` before training starts."""
