"""The network test bed behind :mod:`tools.netbed`, one module per concern.

- :mod:`.host`: constants, errors, and the ``ip``/``tc`` plumbing of namespaces (list,
  empty, delete, clean up after a dead bed);
- :mod:`.shape`: tc-style rates and times, and :class:`~.shape.LinkShape`;
- :mod:`.base`: a bed's state, names, addresses and environment, and running commands
  in its namespaces;
- :mod:`.links`: the switch and the shaped veth links (tbf, netem, nftables loss),
  reshaping, unplugging, counters and the throughput probe;
- :mod:`.nodes`: the Ray nodes in the namespaces (start, wait, kill);
- :mod:`.bed`: :class:`~.bed.NetBed`, the public bed, and its lifecycle;
- :mod:`.cli`: the command line of ``tools/netbed.py``.

Import from :mod:`tools.netbed`, which re-exports the public names.
"""
