"""The package's import graph: no cycle, and no import running up the layers.

Layers, top to bottom: the public modules (``config``, ``trainer``, ``tune``); the
DDP wrapper (``_ddp``); the mode table and the run's worker-side state (``_modes``,
``_runtime``); one package per kind of mode (``_sync``, ``_param``), which never
import each other; the shared client, shard and transport pieces; the leaves. A
module may import its own layer (a leaf another leaf) or any layer below.
"""

import ast
from pathlib import Path

import pytest

import ray_ps_plugin

ROOT = Path(ray_ps_plugin.__file__).parent
PUBLIC, DDP, RUN, MODES, TABLES, PIECES, LEAVES = 6, 5, 4, 3, 2, 1, 0
LAYER_OF = {
    "config": PUBLIC,
    "trainer": PUBLIC,
    "tune": PUBLIC,
    "_ddp": DDP,
    "_backend": DDP,
    "_placement": DDP,
    "_keeper": DDP,
    "_tune_reports": DDP,
    "_modes": RUN,
    "_runtime": RUN,
    "_optim_hooks": RUN,
    "_sync": MODES,
    "_param": MODES,
    "_tables": TABLES,
    "_client": PIECES,
    "_shard": PIECES,
    "_transport": PIECES,
    "_failover": PIECES,
    "_codec": PIECES,
    "_feedback_state": PIECES,
    "_sparse": PIECES,
    "_rows": PIECES,
    "_relays": PIECES,
    "_wire": PIECES,
    "_nonfinite": PIECES,
    "_metrics": PIECES,
    "_types": LEAVES,
    "_errors": LEAVES,
    "_dtypes": LEAVES,
    "_lossy": LEAVES,
    "_feedback": LEAVES,
    "_stats": LEAVES,
    "_shm": LEAVES,
    "_ray_compat": LEAVES,
    "_torch_compat": LEAVES,
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:  # the package's own __init__ only re-exports, lazily
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """``(at import time, anywhere)``: the package's modules that ``name`` imports,
    leaving out imports for type checkers only."""
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    at_import, anywhere = set(), set()

    def targets(node: ast.Import | ast.ImportFrom) -> set[str]:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = package[: len(package) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        local = {n.removeprefix("ray_ps_plugin.") for n in names}
        return {n for n in local if n in modules and n != name}

    def visit(nodes: list[ast.stmt], top: bool) -> None:
        for node in nodes:
            if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
                continue
            if isinstance(node, ast.Import | ast.ImportFrom):
                found = targets(node)
                anywhere.update(found)
                if top:
                    at_import.update(found)
                continue
            inner_top = top and not isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
            )
            for field in ("body", "orelse", "finalbody"):
                visit(getattr(node, field, []), inner_top)
            for handler in getattr(node, "handlers", []):
                visit(handler.body, inner_top)

    visit(ast.parse(path.read_text()).body, True)
    return at_import, anywhere


MODULES = _modules()
GRAPH = {name: _imports(name, path, MODULES) for name, path in MODULES.items()}


def _layer(name: str) -> int:
    top = name.split(".")[0]
    if top not in LAYER_OF:
        pytest.fail(f"{name} has no layer: add {top!r} to LAYER_OF in {__file__}")
    return LAYER_OF[top]


def test_no_module_imports_from_a_layer_above_it():
    upward = [
        f"{name} -> {dep}"
        for name, (_, anywhere) in GRAPH.items()
        for dep in sorted(anywhere)
        if _layer(dep) > _layer(name)
    ]
    assert not upward, upward


def test_the_mode_packages_do_not_import_each_other():
    crossing = [
        f"{name} -> {dep}"
        for name, (_, anywhere) in GRAPH.items()
        for dep in sorted(anywhere)
        if _layer(name) == _layer(dep) == MODES and name.split(".")[0] != dep.split(".")[0]
    ]
    assert not crossing, crossing


def test_the_import_time_graph_has_no_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(GRAPH[name][0]):
            if state.get(dep) == 1:
                cycle = [*path[path.index(dep) :], dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                walk(dep, [*path, dep])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            walk(name, [name])


def test_the_graph_sees_the_packages_imports():
    # A parser that found nothing would pass every test above.
    assert "_sync.plan" in GRAPH["_sync.buckets"][0]
    assert "_modes" in GRAPH["_ddp"][0]


#: A module a reader takes in at one sitting, a function on one screen.
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 450, 60


def _function_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function's body, its docstring left out."""
    body = node.body
    first = body[0]
    is_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
    start = body[1].lineno if is_doc and len(body) > 1 else first.lineno
    assert node.end_lineno is not None
    return node.end_lineno - start + 1


def test_no_module_or_function_outgrows_one_sitting():
    too_long = []
    for name, path in _modules().items():
        source = path.read_text()
        if (n := len(source.splitlines())) > MAX_MODULE_LINES:
            too_long.append(f"{name}: {n} lines")
        for node in ast.walk(ast.parse(source)):
            functions = ast.FunctionDef | ast.AsyncFunctionDef
            if isinstance(node, functions) and (n := _function_lines(node)) > MAX_FUNCTION_LINES:
                too_long.append(f"{name}.{node.name}: a body of {n} lines")
    assert not too_long, too_long
