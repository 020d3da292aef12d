"""Errors the plugin raises inside the training function."""

__all__ = ["PSError", "PSTimeoutError"]


class PSError(RuntimeError):
    """A parameter-server operation failed; the message names the shard and step."""


class PSTimeoutError(PSError, TimeoutError):
    """A server shard did not answer within ``PSConfig.ps_timeout_s``."""
