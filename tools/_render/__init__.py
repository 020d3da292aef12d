"""The docs' generated figures behind :mod:`tools.render_docs`, one module per concern.

- :mod:`.results`: where the results are, and reading them (each file parsed once);
- :mod:`.fmt`: formatting the renderers share (ratios, tables, provenance lines);
- :mod:`.provenance`: when and on which commit each result was measured;
- one module per benchmark family, holding its renderers: :mod:`.step_time`,
  :mod:`.straggler` (and the digits runs), :mod:`.cost_curves`, :mod:`.resnet18`,
  :mod:`.net` (``net_step_time`` on the test bed, and the cost model),
  :mod:`.wire_server`, :mod:`.chaos_soak`, :mod:`.diloco`, :mod:`.recsys`, :mod:`.dlrm`,
  :mod:`.worker_loss`;
- :mod:`.driver`: the markers, the table of renderers, rewriting and checking the
  blocks, and the command line.

Import from :mod:`tools.render_docs`, which re-exports these names.
"""
