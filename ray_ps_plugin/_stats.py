"""Per-worker counters reported by ``get_ps_context().stats``."""

from dataclasses import dataclass, field

__all__ = ["PSStats"]


@dataclass
class PSStats:
    """Live counters of one worker, since its model was prepared.

    Attributes:
        steps: Synchronisation rounds (sync) or updates pushed (async/ssp).
        bytes_pushed: Bytes this worker sent to the shards.
        bytes_pulled: Bytes this worker received from the shards.
        pushes: Messages sent to the shards.
        bytes_pushed_per_shard: ``bytes_pushed`` split by shard.
        last_sync_s: Latency of the latest bucket round trip (sync mode).
        clock: This worker's clock: updates pushed (async/ssp; sync: ``steps``).
        clocks: Every worker's clock as last reported by the shards (async/ssp).
        staleness_max: Largest clock gap seen between this worker and the slowest
            worker whose updates were in the parameters it trained on (async/ssp).
        staleness_mean: Mean of that gap over this worker's steps.
        wait_s: Seconds this worker was blocked waiting for the shards (async/ssp).
        skipped_steps: Optimizer steps dropped for NaN/Inf gradients
            (``nan_policy="skip"``).
        bytes_cross_node: Bytes pushed to and received from shards on other nodes
            than this worker's (the traffic that crosses the network).
    """

    steps: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    pushes: int = 0
    bytes_pushed_per_shard: list[int] = field(default_factory=list)
    last_sync_s: float = 0.0
    clock: int = 0
    clocks: list[int] = field(default_factory=list)
    staleness_max: int = 0
    staleness_mean: float = 0.0
    wait_s: float = 0.0
    skipped_steps: int = 0
    bytes_cross_node: int = 0
