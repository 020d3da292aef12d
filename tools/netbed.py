"""Network test bed: Ray nodes in Linux network namespaces behind rate-limited links.

Every node is a network namespace holding one Ray node (head or worker). The nodes
hang off a bridge that lives in a namespace of its own (the "switch"); each node's
link is a veth pair, shaped in both directions (a token bucket, with netem delay/loss
under it when asked for and the kernel has netem; without netem, loss is an nftables
egress drop rule on each end), so whatever leaves or enters a node
crosses a link of the given rate. Nothing is configured in the host's namespace: the
bed's addresses (198.18.0.0/24, from the range reserved for network benchmarks) exist
only inside its own namespaces, and no route leads out of them.

Command line (root only)::

    python tools/netbed.py --nodes 2 --cpus-per-node 2 --rate 1gbit \\
        [--delay 0ms] [--loss 0] [--probe] -- python benchmarks/net_step_time.py ...

creates the bed, starts the Ray head and workers, runs the command in the head's
namespace with ``RAY_ADDRESS``, ``RAY_AUTH_MODE``, ``GLOO_SOCKET_IFNAME`` and
``PYTHONPATH`` set, prints the bytes each node's link carried during the command,
then tears everything down (also on error, Ctrl-C or SIGTERM).

Library::

    with NetBed(nodes=2, shape=LinkShape(rate="1gbit")) as bed:
        bed.run(["python", "driver.py"], timeout=120)
        bed.set_link(1, rate="100mbit")   # reshape node 1's link while running
        bed.set_link(1, loss=1.0)         # drop 1% each way (netem, else nftables)
        bed.set_link(1, down=True)        # unplug it (delay=... needs netem)

Processes are ended by id: the bed kills exactly what ``ip netns pids`` lists for its
own namespaces, and never runs ``ray stop`` (that would end every Ray on the machine).

The code lives in ``tools/_bed/``, one module per concern (listed in its
``__init__``); this module is the command line and names the public API.
"""

from __future__ import annotations

import sys

if __package__:  # `import tools.netbed`, or `python -m tools.netbed`
    from ._bed.bed import NetBed
    from ._bed.cli import main
    from ._bed.host import NetBedError, list_namespaces, namespace_pids, unavailable_reason
    from ._bed.shape import LinkShape
else:  # `python tools/netbed.py`: tools/ is first on sys.path, the repository root is not
    from _bed.cli import main  # type: ignore[no-redef]

__all__ = [
    "LinkShape",
    "NetBed",
    "NetBedError",
    "list_namespaces",
    "main",
    "namespace_pids",
    "unavailable_reason",
]

if __name__ == "__main__":
    sys.exit(main())
