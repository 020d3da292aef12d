"""A worker's flat host copy of a model's parameters, for the modes whose shards own them.

In async, ssp and diloco the shards hold the parameters and a worker exchanges
*changes* with them. :class:`FlatParams` keeps what that needs on the worker side:
``base``, the values last installed into the model (one flat host vector cut at
the shards' bounds, see :mod:`~ray_ps_plugin._param.layout`), the buffers a
step's change is taken into (straight into a colocated shard's shared memory, else
a host buffer sent by message), and the passes between them and the model's
parameters, per (parameter, shard) piece with no flat intermediate copy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from ray_ps_plugin._codec import as_torch, to_numpy
from ray_ps_plugin._param.layout import pieces, single_dtype
from ray_ps_plugin._shm import Segment

__all__ = ["FlatParams"]

# Elements per chunk of the delta-and-install pass: the chunk's parameters, base,
# delta and reply (4 x 512 KiB in fp32) stay in cache between the three operations
# on it. Smaller chunks cost more in per-operation overhead than they save.
_CHUNK = 1 << 17


class FlatParams:
    """One model's trainable parameters as a flat vector cut at the shards' bounds.

    Args:
        params: The trainable parameters, in ``module.parameters()`` order.
        bounds: Element offsets of each shard's slice (``split_bounds``).
        inputs: The input segment of each colocated shard, by shard index: a
            step's change for that shard is written straight into it (a segment of
            two slices holds two changes, used by clock parity: :meth:`use_half`).

    Raises:
        TypeError: If the parameters are not all of one floating dtype.
    """

    def __init__(
        self, params: Sequence[torch.Tensor], bounds: list[int], inputs: dict[int, Segment]
    ) -> None:
        self.params = list(params)
        dtype = single_dtype(self.params)
        numel = bounds[-1]
        self.bounds = bounds
        # The values last put into the model: a step's delta is the parameters after
        # the optimizer step minus these.
        self.base = torch.empty(numel, dtype=dtype)
        # Only shards reached by message need a host delta.
        by_message = len(inputs) < len(bounds) - 1
        self.delta = torch.empty(numel if by_message else 0, dtype=dtype)
        self.on_gpu = any(p.is_cuda for p in self.params)
        self._staging = torch.empty(numel if self.on_gpu else 0, dtype=dtype)
        # Whether a pass over the parameters' flat views writes the model itself
        # (contiguous CPU parameters), or the values go in with a copy afterwards.
        self._writes_in_place = not self.on_gpu and all(p.is_contiguous() for p in self.params)
        self.np_dtype = to_numpy(self.base).dtype
        # Where each shard's delta is taken, by clock parity: its shared memory (a
        # half of it where it holds two), or ``delta``.
        self._halves = [
            [
                self.segment_tensor(inputs[s], b - a, half) if s in inputs else self.delta[a:b]
                for s, (a, b) in enumerate(self.slices())
            ]
            for half in (0, 1)
        ]
        #: Where each shard's delta is taken now (see :meth:`use_half`).
        self.delta_parts = self._halves[0]
        # Shards whose delta stays in place until it is written again two clocks on
        # (their halves differ: segment_tensor found room for two).
        self._two = {
            s for s in inputs if self._halves[0][s].data_ptr() != self._halves[1][s].data_ptr()
        }
        self.pieces = pieces([p.numel() for p in self.params], bounds)
        # Each parameter's first element in the flat vector (also for empty ones,
        # which have no piece).
        self._offsets = list(itertools.accumulate((p.numel() for p in self.params), initial=0))
        self.snapshot()

    def use_half(self, clock: int) -> None:
        """Takes the next delta into the half of two-delta inputs ``clock`` uses."""
        self.delta_parts = self._halves[clock % 2]

    def held_part(self, shard: int, sent: torch.Tensor | None = None) -> np.ndarray:
        """What ``shard`` applies of this step's change (``sent``: the decoded values
        a message carried, else the part in its buffer), in the dtype shards compute
        in: kept until the shard's replica holds it. The part itself where it stays
        in place long enough (a two-delta input, in that dtype), else a copy."""
        values = self.delta_parts[shard] if sent is None else sent
        if sent is None and shard in self._two and values.element_size() >= 4:
            return values.numpy()
        wide = torch.float32 if values.element_size() < 4 else values.dtype
        out: np.ndarray = values.to(wide, copy=True).numpy()
        return out

    def slices(self) -> list[tuple[int, int]]:
        """Each shard's ``(first, one past the last)`` element."""
        return list(zip(self.bounds, self.bounds[1:]))

    def segment_tensor(self, seg: Segment, numel: int, half: int = 0) -> torch.Tensor:
        """``numel`` values of a shared-memory segment, as a tensor: the first, or
        for ``half=1`` of a segment that holds two, the second ``numel``."""
        offset = numel * self.np_dtype.itemsize
        two = seg.handle.nbytes >= 2 * offset
        return as_torch(seg.view(offset if half and two else 0, self.np_dtype, numel))

    def snapshot(self) -> None:
        """``base = params``."""
        self._flatten(self.base)

    def _flatten(self, out: torch.Tensor) -> None:
        flat = [p.detach().reshape(-1) for p in self.params]
        if not flat:
            return
        if not self.on_gpu:
            torch.cat(flat, out=out)
        else:  # GPU parameters are staged through the host buffer
            out.copy_(torch.cat(flat))

    def host_params(self) -> list[torch.Tensor]:
        """Flat host views of the parameters (a staged copy when they live on GPU)."""
        if not self.on_gpu:
            return [p.detach().reshape(-1) for p in self.params]
        self._flatten(self._staging)
        return [self._staging[o : o + p.numel()] for o, p in zip(self._offsets, self.params)]

    def write_params(self) -> None:
        """Copies ``base`` into the parameters (host to device for GPU ones)."""
        for o, p in zip(self._offsets, self.params):
            p.detach().copy_(self.base[o : o + p.numel()].view(p.shape))

    def install(self, sources: list[torch.Tensor]) -> None:
        """``base = params = sources`` (each shard's slice)."""
        with torch.no_grad():
            for pc in self.pieces:
                src = sources[pc.shard][pc.s0 : pc.s0 + pc.numel]
                self.base[pc.flat0 : pc.flat0 + pc.numel].copy_(src)
            self.write_params()

    def take_delta(self, check: bool) -> list[torch.Tensor]:
        """``delta = params - base`` into the delta parts; returns per-piece sums
        (fp32) when ``check``, for a finiteness test, else nothing."""
        host = self.host_params()
        sums: list[torch.Tensor] = []
        with torch.no_grad():
            for pc in self.pieces:
                delta = self.delta_parts[pc.shard][pc.s0 : pc.s0 + pc.numel]
                base = self.base[pc.flat0 : pc.flat0 + pc.numel]
                torch.sub(host[pc.param][pc.p0 : pc.p1], base, out=delta)
                if check:
                    sums.append(delta.sum(dtype=torch.float32))
        return sums

    def advance(
        self, sources: list[torch.Tensor] | None, scale: float, check: bool
    ) -> list[torch.Tensor]:
        """Takes the delta and installs ``sources + delta * scale`` (``base + delta *
        scale`` where ``sources`` is ``None``) into ``base`` and, where it can write
        them in place, the parameters (:meth:`publish` completes the install);
        returns per-chunk sums of the delta (fp32) when ``check``.

        One pass per chunk small enough to stay in cache: delta = params - base;
        params = source + delta * scale; base = params. Memory traffic, not
        arithmetic, is what these passes cost: each chunk's parameters and base are
        read from memory once, and everything after the first operation on it hits
        the cache.
        """
        host = self.host_params()
        sums: list[torch.Tensor] = []
        with torch.no_grad():
            for pc in self.pieces:
                n = pc.numel
                cur = host[pc.param][pc.p0 : pc.p1]
                base = self.base[pc.flat0 : pc.flat0 + n]
                delta = self.delta_parts[pc.shard][pc.s0 : pc.s0 + n]
                src = base if sources is None else sources[pc.shard][pc.s0 : pc.s0 + n]
                for lo in range(0, n, _CHUNK):
                    hi = min(lo + _CHUNK, n)
                    c, b, d = cur[lo:hi], base[lo:hi], delta[lo:hi]
                    torch.sub(c, b, out=d)
                    if check:
                        sums.append(d.sum(dtype=torch.float32))
                    # Into the parameters first, then base from them: the install
                    # writes the chunk the optimizer step left in cache.
                    torch.add(src[lo:hi], d, alpha=scale, out=c)
                    b.copy_(c)
        return sums

    def publish(self) -> None:
        """Makes the model's parameters hold ``base`` after :meth:`advance` (a copy
        only where that pass could not write them in place: GPU or non-contiguous
        parameters)."""
        if not self._writes_in_place:
            with torch.no_grad():
                self.write_params()
