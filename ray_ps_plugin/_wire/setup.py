"""Opening the direct path at a run's start: each shard listens, the workers learn where.

Called by the backend once every shard answered ``ready`` (a mode's ``connect``);
the :class:`Wires` it returns reach every worker with the rest of the run's
description, and each worker process opens its :class:`~ray_ps_plugin._wire.streams.
WireStreams` from them.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ray_ps_plugin._types import RunSettings
from ray_ps_plugin._wire.frames import TOKEN_BYTES
from ray_ps_plugin._wire.streams import WireStreams

__all__ = ["Wires", "open_streams", "open_wires"]


@dataclass(frozen=True)
class Wires:
    """Where the run's shards listen on the direct path.

    Attributes:
        addresses: ``(host, port)`` of each shard, by shard index (empty: the run
            has no direct path, ``data_path="object_store"``).
        token: The run's secret every connection starts with.
    """

    addresses: tuple[tuple[str, int] | None, ...] = ()
    token: bytes = field(default=b"", repr=False)


def open_wires(servers: Sequence[Any], settings: RunSettings) -> Wires:
    """Has every shard listen on its node's address (with ``data_path="tcp"``).

    Raises:
        TimeoutError: If a shard does not answer within ``ps_start_timeout_s``.
    """
    if settings.data_path != "tcp":
        return Wires()
    import ray

    token = secrets.token_bytes(TOKEN_BYTES)
    timeout = settings.ps_start_timeout_s
    try:
        opened = ray.get([s.open_wire.remote(token) for s in servers], timeout=timeout)
    except ray.exceptions.GetTimeoutError as e:
        raise TimeoutError(
            f"the parameter-server shards did not open their direct paths within "
            f"ps_start_timeout_s={timeout:g}s."
        ) from e
    return Wires(tuple((str(host), int(port)) for host, port in opened), token)


def open_streams(wires: Wires, connect_timeout_s: float) -> WireStreams | None:
    """A worker process's connections to the shards (each opens on first use), or
    ``None`` where the run has no direct path. One per process, shared by every
    model it prepares: connections grow with the shards, not with the models."""
    if not wires.addresses:
        return None
    return WireStreams(wires.addresses, wires.token, connect_timeout_s)
