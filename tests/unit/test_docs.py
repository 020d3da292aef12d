"""The docs against what they cite: measured figures, tests and source files.

Fast and without Ray: reads Markdown, JSON and CSV only.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# `tests/unit/test_x.py::test_name`, or `::test_name` for the file named last before it.
TEST_REF = re.compile(r"`(?P<path>tests/[\w/]+\.py)?::(?P<name>\w+)`")
# A backticked file name such as `config.py`, `_sync/client.py` or `tests/unit/fakes.py`.
FILE_REF = re.compile(r"`(?P<path>[\w/]+\.py)`")
# Files of the reader's own project that the docs use in examples.
USER_FILES = {"train.py"}


def _render_docs():
    from tools import render_docs

    return render_docs


def _cited_tests():
    """(doc, test file, test name) of every ``path::name`` reference in the docs."""
    refs = []
    for doc in DOCS:
        path = None
        for m in TEST_REF.finditer(doc.read_text()):
            path = m["path"] or path
            refs.append((doc.relative_to(ROOT).as_posix(), path, m["name"]))
    return refs


def test_generated_figures_match_the_benchmark_results():
    stale = _render_docs().stale_blocks()
    assert not stale, (
        "docs differ from benchmarks/results; run `python tools/render_docs.py`:\n"
        + "\n".join(stale)
    )


def test_the_check_exits_zero_when_nothing_is_stale():
    assert _render_docs().main(["--check"]) == 0


def test_a_stale_or_broken_block_is_reported():
    rd = _render_docs()
    text = "a <!-- generated: step_ratio ps_sync -->9.99×<!-- end generated --> b"
    new, stale = rd.render_text(text, "x.md")
    assert stale == ["x.md: step_ratio ps_sync"] and "9.99×" not in new
    with pytest.raises(rd.RenderError, match="unknown renderer"):
        rd.render_text("<!-- generated: nope -->x<!-- end generated -->", "x.md")
    with pytest.raises(rd.RenderError, match="no matching end marker"):
        rd.render_text("<!-- generated: step_ratio ps_sync -->x", "x.md")


def test_every_cited_test_exists():
    refs = _cited_tests()
    assert len(refs) > 20, "the reference pattern no longer matches the docs"
    missing = []
    for doc, path, name in refs:
        if path is None:
            missing.append(f"{doc}: ::{name} follows no test file")
            continue
        source = ROOT / path
        if not source.is_file():
            missing.append(f"{doc}: {path} does not exist")
        elif not re.search(rf"^\s*(async\s+)?def {name}\(", source.read_text(), re.M):
            missing.append(f"{doc}: {path} has no test {name}")
    assert not missing, "\n".join(missing)


def test_every_cited_source_file_exists():
    """A module named in the docs is a path from the repository root or the package."""
    missing = []
    for doc in DOCS:
        for m in FILE_REF.finditer(doc.read_text()):
            path = m["path"]
            if path in USER_FILES:
                continue
            if not ((ROOT / path).is_file() or (ROOT / "ray_ps_plugin" / path).is_file()):
                missing.append(f"{doc.relative_to(ROOT).as_posix()}: {path}")
    assert not missing, "\n".join(missing)


def test_every_result_the_readme_quotes_records_its_commit(monkeypatch):
    """The README's figures come from results that name the code they measured, so
    ``render_docs.py --staleness`` can tell when the package has moved on since."""
    rd = _render_docs()
    from tools._render import results

    read = []
    original = results._json

    def recording(name):
        read.append(name)
        return original(name)

    monkeypatch.setattr(results, "_json", recording)
    rd.render_text((ROOT / "README.md").read_text(), "README.md")
    assert read, "the README quotes no measured figure"
    missing = sorted({n for n in read if "commit" not in original(n)})
    assert not missing, f"results without a recorded commit: {missing}"


def test_the_staleness_report_names_every_result():
    rd = _render_docs()
    lines = rd.staleness_report()
    assert len(lines) == len(rd.result_files())
    assert all(line.startswith(p.name + ":") for line, p in zip(lines, rd.result_files()))


def test_the_architecture_names_every_module():
    """docs/architecture.md's module table names every module of the package, as a
    file (``_backend.py``, ``_sync/shard.py``) or, for a package, its folder."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("## Modules") : text.index("### Several models")]
    package = ROOT / "ray_ps_plugin"
    missing = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel == "__init__.py":
            continue
        folder = rel.rsplit("/", 1)[0] + "/" if "/" in rel else None
        named = f"`{rel}`" in table or (rel.endswith("/__init__.py") and f"`{folder}`" in table)
        if not named:
            missing.append(rel)
    assert not missing, f"docs/architecture.md's module table leaves out {missing}"
