"""Communication-only cost of one PS-sync step, by chunk size (no model, no DDP).

Two worker actors each push a 23 MB fp32 buffer (the reference MLP's gradient) to two
SumShard actors through the object store, cut into chunks, and wait for the sums: the
cost docs/benchmarks.md attributes to per-object overhead. Variants: ``base`` (one put
per chunk, as the plugin does today) and ``slice`` (one put per step shared by all
shards, each reading its slice).

    python benchmarks/comm_only.py [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import ray

from ray_ps_plugin._sync.shard import SumShard


class _SliceServer(SumShard):
    async def push_slice(self, step: int, key: int, rank: int, whole: np.ndarray, a: int, b: int):
        return await self.push_pull(0, step, key, rank, whole[a:b], "float32")


@ray.remote(num_cpus=1)
class _Worker:
    def __init__(self, rank: int, servers: list, numel: int) -> None:
        self.rank, self.servers, self.buf = rank, servers, np.ones(numel, np.float32)

    def run(self, steps: int, chunk_bytes: int, variant: str) -> float:
        n, half, per = self.buf.size, self.buf.size // 2, chunk_bytes // 4
        cuts = [
            (s, a, min(a + per, hi))
            for s, (lo, hi) in enumerate([(0, half), (half, n)])
            for a in range(lo, hi, per)
        ]
        times = []
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            if variant == "slice":
                whole = ray.put(self.buf)
                refs = [
                    self.servers[s].push_slice.remote(step, a, self.rank, whole, a, b)
                    for s, a, b in cuts
                ]
            else:
                refs = [
                    self.servers[s].push_pull.remote(
                        0, step, a, self.rank, self.buf[a:b], "float32"
                    )
                    for s, a, b in cuts
                ]
            for (_, a, b), r in zip(cuts, ray.get(refs, timeout=60)):
                self.buf[a:b] = r
            times.append(time.perf_counter() - t0)
        return statistics.median(times[3:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--numel", type=int, default=5_800_000)
    args = p.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    print("| variant | chunk (MiB) | comm-only step (ms), worker 0 / worker 1 |\n|---|---|---|")
    for variant in ("base", "slice"):
        for mib in (1, 4, 16):
            servers = [
                ray.remote(_SliceServer).options(num_cpus=0).remote(i, 2, 60) for i in range(2)
            ]
            ray.get([s.ready.remote() for s in servers], timeout=60)
            workers = [_Worker.remote(r, servers, args.numel) for r in range(2)]
            ms = ray.get(
                [w.run.remote(args.steps, mib << 20, variant) for w in workers], timeout=600
            )
            print(f"| {variant} | {mib} | {ms[0] * 1e3:.1f} / {ms[1] * 1e3:.1f} |", flush=True)
            for a in servers + workers:
                ray.kill(a)
    ray.shutdown()


if __name__ == "__main__":
    main()
