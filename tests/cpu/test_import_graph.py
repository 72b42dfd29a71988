"""jax_ub's modules import one another one way: no import cycle, function-level imports included.

Every module under ``jax_ub/`` is parsed with ``ast`` (nothing is imported): each ``import`` and
``from ... import`` of a ``jax_ub`` module is an edge, wherever it stands, except inside an
``if TYPE_CHECKING:`` block. ``pkg/__init__.py`` is the module ``jax_ub.pkg``; relative imports are
resolved; ``from pkg import name`` is an edge to ``pkg.name`` where that is a module, else to
``pkg``. An import of one of a module's own packages (``from jax_ub import __version__`` in
``jax_ub.x``) is no edge: Python initialises a package before any module in it, so the import
orders nothing.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = "jax_ub"


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """``jax_ub/comm/lifecycle.py`` -> ``jax_ub.comm.lifecycle``; ``jax_ub/comm/__init__.py`` ->
    ``jax_ub.comm``."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement in ``tree``, at any depth, but those under ``if TYPE_CHECKING:``
    (their ``else:`` branch counts)."""
    out: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            out.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def _resolve_from(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module named by ``from <node.module> import ...`` in module ``name``."""
    if not node.level:
        return node.module or ""
    base = name.split(".") if is_package else name.split(".")[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def edges_of(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The jax_ub modules that module ``name`` (``is_package``: an ``__init__.py``) imports."""
    targets: set[str] = set()
    for node in _imports(ast.parse(source)):
        if isinstance(node, ast.Import):
            found = [alias.name for alias in node.names]
        else:
            base = _resolve_from(node, name, is_package)
            found = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        for target in found:
            while target and target not in modules:  # `import jax_ub.comm.x.attr`-like spellings
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                targets.add(target)
    return targets


def graph(root: pathlib.Path, package: str = PACKAGE) -> dict[str, set[str]]:
    """``{module: modules it imports}`` over every ``.py`` file under ``root / package``."""
    files = {module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
    modules = set(files)
    return {
        name: edges_of(p.read_text(), name, p.name == "__init__.py", modules) for name, p in files.items()
    }


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``g`` as ``[a, b, ..., a]``, or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(g):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(g.get(start, ())))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(g.get(nxt, ()))))
    return None


def test_jax_ub_has_no_import_cycle():
    g = graph(ROOT)
    assert "jax_ub.ops" in g and "jax_ub" in g  # the walk found the package
    cycle = find_cycle(g)
    assert cycle is None, "import cycle in jax_ub: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    ("g", "want"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),  # a diamond is no cycle
        ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
        ({"a": {"a"}}, ["a", "a"]),
        ({"x": set(), "a": {"x", "b"}, "b": {"c"}, "c": {"d"}, "d": {"a"}}, ["a", "b", "c", "d", "a"]),
    ],
)
def test_find_cycle_on_small_graphs(g, want):
    assert find_cycle(g) == want


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_graph_reads_every_spelling_of_an_import(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.api import f\n__version__ = '1'\n",
            "pkg/api.py": "from pkg import low\n\ndef f():\n    from . import sub\n    import pkg.sub.deep\n",
            "pkg/low.py": "from pkg import __version__\nimport typing\nif typing.TYPE_CHECKING:\n"
            "    from pkg import api\nelse:\n    pass\n",
            "pkg/sub/__init__.py": "from .deep import g\n",
            "pkg/sub/deep.py": "from ..low import x\nfrom .. import api as _api\n",
        },
    )
    g = graph(tmp_path, "pkg")
    assert g == {
        "pkg": {"pkg.api"},
        "pkg.api": {"pkg.low", "pkg.sub", "pkg.sub.deep"},
        "pkg.low": set(),  # its package (no edge) and a TYPE_CHECKING import (none)
        "pkg.sub": {"pkg.sub.deep"},
        "pkg.sub.deep": {"pkg.low", "pkg.api"},
    }
    assert find_cycle(g) == ["pkg.api", "pkg.sub", "pkg.sub.deep", "pkg.api"]


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg import b\n",
            "pkg/b.py": "def f():\n    from pkg.a import g  # no cycle at import time, one in the graph\n",
        },
    )
    assert find_cycle(graph(tmp_path, "pkg")) == ["pkg.a", "pkg.b", "pkg.a"]
