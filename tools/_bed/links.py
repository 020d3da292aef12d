"""The bed's network: namespaces, the switch, veth links, and their shaping.

Building the switch and one shaped link per node, reshaping a link while the bed runs
(rate, delay and loss through tc's tbf and netem, or loss through nftables where the
kernel has no netem), unplugging it, and reading its counters.
"""

from __future__ import annotations

import json
import re
import select
import shutil
import subprocess
import sys
from dataclasses import replace

from .base import _BedBase
from .host import _IP_TIMEOUT_S, IFNAME, NFT_TABLE, NetBedError, _ip, _NoNetem, _run_tool, _tc
from .shape import LinkShape


class _Links(_BedBase):
    """The namespaces and shaped links of a :class:`~tools.netbed.NetBed`."""

    # -- building ------------------------------------------------------------------

    def _build_network(self) -> None:
        sw = self.switch_ns
        self._add_ns(sw)
        _ip("link", "add", "br0", "type", "bridge", ns=sw)
        _ip("link", "set", "br0", "up", ns=sw)
        for i in range(self.nodes):
            ns, port = self.node_ns(i), f"n{i}"
            self._add_ns(ns)
            # Both ends are created inside the bed's namespaces: nothing ever appears
            # in the host's, so names cannot clash with the host or with other beds.
            _ip("link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns, ns=sw)
            _ip("link", "set", port, "master", "br0", ns=sw)
            _ip("link", "set", port, "up", ns=sw)
            _ip("addr", "add", f"{self.node_ip(i)}/24", "dev", IFNAME, ns=ns)
            _ip("link", "set", IFNAME, "up", ns=ns)
            self._apply_shape(i, new=True)

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("link", "set", "lo", "up", ns=ns)
        # IPv6 would only add router solicitations and DAD to the byte counters.
        _run_tool(
            "ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv6.conf.all.disable_ipv6=1"
        )

    def _apply_shape(self, i: int, new: bool = False) -> None:
        """Installs (or changes) node ``i``'s shaping on both ends of its link.

        A token bucket is the root qdisc. Delay and loss need netem, added as the
        bucket's child the first time they are asked for (not before: some kernels
        are built without netem, and rate limiting alone must work there). Where the
        kernel has no netem, loss (not delay) falls back to nftables: a netdev egress
        chain on each end drops that share of the packets leaving it.
        """
        s = self._shapes[i]
        for ns, dev in self._ends(i):
            verb = "add" if new else "change"
            tbf = f"rate {s.rate} burst {s.burst_bytes()} latency {s.queue}"
            _tc(*f"qdisc {verb} dev {dev} root handle 1: tbf {tbf}".split(), ns=ns)
        if self._netem[i] or s.delay_s() > 0 or (s.loss > 0 and self._has_netem is not False):
            try:
                self._apply_netem(i)
                return
            except _NoNetem as e:
                if s.delay_s() > 0:
                    raise NetBedError(
                        "this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so delay "
                        "cannot be emulated; rate limits, down links and loss (through "
                        "nftables) still work"
                    ) from e
        if s.loss > 0 or self._nft_loss[i]:
            self._apply_nft_loss(i)

    def _ends(self, i: int) -> tuple[tuple[str, str], tuple[str, str]]:
        """(namespace, device) of both ends of node ``i``'s link: node, then switch."""
        return (self.node_ns(i), IFNAME), (self.switch_ns, f"n{i}")

    def _apply_netem(self, i: int) -> None:
        """Adds or changes netem (delay and loss) under node ``i``'s token buckets.

        Raises:
            _NoNetem: The kernel has no netem (remembered for the bed's lifetime).
        """
        s = self._shapes[i]
        for ns, dev in self._ends(i):
            verb = "change" if self._netem[i] else "add"
            # A queue deep enough for a bandwidth-delay product of TSO super-packets.
            netem = f"delay {s.delay} loss {float(s.loss)}% limit 100000"
            try:
                _tc(*f"qdisc {verb} dev {dev} parent 1:1 handle 10: netem {netem}".split(), ns=ns)
            except NetBedError as e:
                if "unknown" in str(e).lower():
                    self._has_netem = False
                    raise _NoNetem(str(e)) from e
                raise
        self._has_netem = True
        self._netem[i] = True

    def _apply_nft_loss(self, i: int) -> None:
        """Drops ``loss`` percent of the packets leaving each end of node ``i``'s link.

        One netdev table per end, replaced atomically (declare, delete, define in one
        ``nft -f``); loss 0 removes it. The tables live in the bed's namespaces, so
        they go with them. The counter lets :meth:`dropped` report what was dropped.
        """
        if shutil.which("nft") is None:
            raise NetBedError(
                "packet loss needs netem (CONFIG_NET_SCH_NETEM), which this kernel lacks, "
                "or the nft command (package nftables) for a netdev egress drop rule"
            )
        s = self._shapes[i]
        # numgen draws a uniform integer per packet: keep [0, loss * 100) of 10000.
        threshold = round(float(s.loss) * 100)
        for ns, dev in self._ends(i):
            table = f"table netdev {NFT_TABLE}_{dev}"
            script = f"{table}\ndelete {table}\n"
            if threshold > 0:
                script += (
                    f"{table} {{\n chain egress {{\n"
                    f'  type filter hook egress device "{dev}" priority 0; policy accept;\n'
                    f"  numgen random mod 10000 < {threshold} counter drop\n }}\n}}\n"
                )
            self._nft(ns, script)
        self._nft_loss[i] = threshold > 0

    def _nft(self, ns: str, script: str) -> str:
        """Runs an nft script in namespace ``ns``."""
        try:
            p = subprocess.run(
                ["ip", "netns", "exec", ns, "nft", "-f", "-"],
                input=script,
                check=False,
                capture_output=True,
                text=True,
                timeout=_IP_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired as e:
            raise NetBedError(f"nft in {ns} timed out after {_IP_TIMEOUT_S} s") from e
        if p.returncode != 0:
            raise NetBedError(
                f"nft in {ns} failed ({p.returncode}): {p.stderr.strip()} (a netdev egress "
                "hook needs Linux 5.16 or later)"
            )
        return p.stdout

    def dropped(self, node: int) -> int:
        """Packets the emulated loss dropped on node ``node``'s link, both directions.

        Counts netem's drops or the nftables rule's, whichever emulates the loss.
        """
        total = 0
        for ns, dev in self._ends(node):
            if self._netem[node]:
                for q in json.loads(_tc("-s", "-j", "qdisc", "show", "dev", dev, ns=ns)):
                    if q.get("kind") == "netem":
                        total += int(q.get("drops", 0))
            elif self._nft_loss[node]:
                out = self._nft(ns, f"list table netdev {NFT_TABLE}_{dev}\n")
                total += sum(int(n) for n in re.findall(r"counter packets (\d+)", out))
        return total

    # -- shaping and counters ------------------------------------------------------

    def shape(self, node: int) -> LinkShape:
        """The current shaping of node ``node``'s link."""
        self._check_node(node)
        return self._shapes[node]

    def set_link(
        self,
        node: int,
        *,
        rate: str | None = None,
        delay: str | None = None,
        loss: float | None = None,
        down: bool | None = None,
    ) -> LinkShape:
        """Changes node ``node``'s link while the bed runs; unset arguments stay.

        Args:
            node: Node index.
            rate: New token-bucket rate (tc syntax).
            delay: New one-way delay per direction (tc syntax).
            loss: New loss percentage per direction.
            down: ``True`` unplugs the link (the switch's port goes down, so the node
                loses carrier); ``False`` plugs it back.

        Returns:
            The link's shaping now.
        """
        self._check_node(node)
        changes = {
            k: v for k, v in (("rate", rate), ("delay", delay), ("loss", loss)) if v is not None
        }
        if changes:
            old = self._shapes[node]
            self._shapes[node] = replace(old, **changes)
            try:
                self._apply_shape(node)
            except NetBedError:
                self._shapes[node] = old  # what the link still has
                raise
        if down is not None and down != self._down[node]:
            _ip("link", "set", f"n{node}", "down" if down else "up", ns=self.switch_ns)
            self._down[node] = down
        return self._shapes[node]

    def link_bytes(self, node: int) -> dict[str, int]:
        """Byte counters of node ``node``'s end of its link.

        Returns:
            ``{"tx": bytes the node sent, "rx": bytes it received}`` since creation.
        """
        out = _ip("-j", "-s", "link", "show", "dev", IFNAME, ns=self.node_ns(node))
        stats = json.loads(out)[0]["stats64"]
        return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}

    def probe(self, src: int, dst: int, nbytes: int = 32 << 20, timeout: float = 60.0) -> float:
        """Measures the throughput of one TCP stream from node ``src`` to ``dst``.

        Args:
            src: Sending node.
            dst: Receiving node.
            nbytes: Bytes to send.
            timeout: Bound on the whole measurement.

        Returns:
            Bits per second seen by the receiver (first to last byte).
        """
        port = 5999
        recv = (
            "import socket, time\n"
            "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
            f"s.bind(('{self.node_ip(dst)}', {port})); s.listen(1); s.settimeout({timeout})\n"
            "print('ready', flush=True)\n"
            "c, _ = s.accept(); c.settimeout(" + str(timeout) + "); n = 0; t0 = None\n"
            "while True:\n"
            "    b = c.recv(1 << 20)\n"
            "    if not b: break\n"
            "    t0 = t0 or time.perf_counter(); n += len(b)\n"
            "print(n * 8 / (time.perf_counter() - t0), flush=True)\n"
        )
        send = (
            "import socket\n"
            f"c = socket.create_connection(('{self.node_ip(dst)}', {port}), timeout={timeout})\n"
            f"buf = bytes(1 << 20)\n"
            f"for _ in range({max(1, nbytes >> 20)}): c.sendall(buf)\n"
            "c.close()\n"
        )
        rx = subprocess.Popen(
            ["ip", "netns", "exec", self.node_ns(dst), sys.executable, "-c", recv],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert rx.stdout is not None
            # Bounded wait for the receiver's "ready" line (readline alone could block).
            readable, _, _ = select.select([rx.stdout], [], [], timeout)
            if not readable or rx.stdout.readline().strip() != "ready":
                raise NetBedError("throughput probe: receiver did not start")
            self.exec(src, [sys.executable, "-c", send], timeout=timeout, capture=True)
            out, _ = rx.communicate(timeout=timeout)
            return float(out.strip())
        finally:
            if rx.poll() is None:
                rx.kill()
                rx.wait(timeout=10)
