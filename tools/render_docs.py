"""Regenerates every measured figure in the docs from ``benchmarks/results``.

Figures lie between ``<!-- generated: NAME ARGS -->`` and ``<!-- end generated -->``
markers in ``README.md`` and ``docs/*.md``; ``NAME`` is a renderer, ``ARGS`` its
arguments (the full description: ``python tools/render_docs.py --help``). Usage::

    python tools/render_docs.py              # rewrite the blocks in place
    python tools/render_docs.py --check      # exit 1 and list the stale blocks
    python tools/render_docs.py --staleness  # each result's commit, and commits since

The code lives in ``tools/_render/``, one module per concern (listed in its
``__init__``); this module is the command line and names what tests use.
"""

from __future__ import annotations

import sys

if __package__:  # `import tools.render_docs`, or `python -m tools.render_docs`
    from ._render.driver import main, render_text, stale_blocks
    from ._render.provenance import result_files, staleness_report
    from ._render.results import RenderError
else:  # `python tools/render_docs.py`: tools/ is first on sys.path, the repository root is not
    from _render.driver import main  # type: ignore[no-redef]

__all__ = [
    "RenderError",
    "main",
    "render_text",
    "result_files",
    "stale_blocks",
    "staleness_report",
]

if __name__ == "__main__":
    sys.exit(main())
