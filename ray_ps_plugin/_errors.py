"""Errors the plugin raises inside the training function."""

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["PSError", "PSTimeoutError", "WaitTimeout", "failed_indices"]


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


def failed_indices(wait: Callable[[list[Any], float], Any], handles: Sequence[Any]) -> list[int]:
    """Indices of the calls that failed (rather than still running).

    Used after a batch wait raised, so the error can name the shard whose call
    failed (e.g. a dead actor) instead of every shard the batch touched.

    Args:
        wait: A transport's ``wait(handles, timeout_s)``.
        handles: The calls of the batch, in order.
    """
    failed = []
    for i, handle in enumerate(handles):
        try:
            wait([handle], 0.01)
        except WaitTimeout:
            continue
        except Exception:  # noqa: BLE001 - a failed call is what we look for
            failed.append(i)
    return failed
