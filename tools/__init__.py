"""Project tooling that is neither the product nor a benchmark.

- :mod:`tools.netbed`: the network test bed (Ray nodes in network namespaces behind
  shaped links), used by the network benchmarks and by ``tests/integration``;
- :mod:`tools.render_docs`: the figures in ``docs/`` regenerated from
  ``benchmarks/results/`` (checked by ``tests/unit/test_docs.py``);
- :mod:`tools.plot_wins`: the README's picture, from the same results.

Each also runs as a script: ``python tools/<name>.py --help``. The code of the first
two lives in the private packages ``tools/_bed/`` and ``tools/_render/``, one module
per concern; ``netbed.py`` and ``render_docs.py`` re-export their names.
"""
