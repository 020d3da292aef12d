"""Errors the plugin raises inside the training function."""

__all__ = [
    "PSError",
    "PSTimeoutError",
    "ShardLinkError",
    "ShardProtocolError",
    "ShardTimeoutError",
    "WaitTimeout",
]


class PSError(RuntimeError):
    """A parameter-server operation failed; the message names the shard and step."""


class PSTimeoutError(PSError, TimeoutError):
    """A server shard did not answer within ``PSConfig.ps_timeout_s``."""


class WaitTimeout(TimeoutError):
    """A worker's own wait for a shard ran out (raised by the transports).

    Distinct from a shard's error that is itself a ``TimeoutError`` (Ray re-raises
    remote errors as subclasses of their class): that one carries the shard's
    diagnosis, e.g. which workers it waited for, and must reach the user intact.
    """


class ShardTimeoutError(TimeoutError):
    """Raised inside a shard: it waited longer than ``ps_timeout_s`` for workers."""


class ShardProtocolError(RuntimeError):
    """Raised inside a shard: a call cannot belong to this run (e.g. the workers'
    models differ, or a step or clock is out of order)."""


class ShardLinkError(ConnectionError):
    """Raised inside a shard: its direct path to another shard failed (the other
    shard, its node or the link between them is gone)."""
