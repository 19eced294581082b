"""The house rules a reader relies on: docs/architecture.md names only modules and functions that exist, no module of
the package imports itself back through others (module-level, `TYPE_CHECKING` or function-level imports alike), and
the core cut modules name no allocation (each row's own steps are reached through its registry row)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from prunelight.allocation import ALLOCATIONS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "prunelight"
DOC = ROOT / "docs" / "architecture.md"
# Backticked YAML keys read like module paths (`export.format` is a setting, not prunelight/export.py's `format`).
CONFIG_SECTIONS = ("prune.", "export.", "evaluation.", "data.", "model.", "trainer.")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, text: str | None = None) -> set[str]:
    """Every prunelight module `path` imports, wherever the import statement is (resolved to a module file)."""
    name = _module_name(path)
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(text if text is not None else path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                pkg = base.split(".")[: len(base.split(".")) - (node.level - 1)]
                module = ".".join(pkg + ([module] if module else []))
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        for target in targets:
            while target and target not in MODULES:  # `from pkg import name`: the module, or the package itself
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circles_of_any_kind():
    graph = {name: _imports(path) for name, path in MODULES.items()}
    assert _circles(graph) == []


def test_the_circle_finder_sees_type_only_and_function_level_imports():
    """The rule above can fail: an import under TYPE_CHECKING and one inside a function are edges like any other."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    src = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from prunelight.cut import run_cut\n"
           "def f():\n    from .pipeline import make_plan\n")
    assert _imports(PACKAGE / "plan.py", src) == {"prunelight.cut", "prunelight.pipeline"}


def _doc_tokens() -> list[str]:
    return re.findall(r"`([^`\s]+)`", DOC.read_text())


def test_every_path_architecture_md_names_exists():
    paths = [t for t in _doc_tokens() if "<" not in t and re.fullmatch(r"[\w./-]+(\.(py|mjs|md|yaml)|/)", t)]
    assert len(paths) > 40
    missing = [t for t in paths
               if not any((base / t).exists() for base in (PACKAGE, ROOT, ROOT / "docs", ROOT / "tests"))]
    assert missing == []


def test_every_function_architecture_md_names_exists():
    """A backticked `module.name` (or `prunelight.name`) whose first part is a prunelight module must resolve."""
    refs = [t for t in _doc_tokens() if re.fullmatch(r"[a-z_]\w*(\.\w+)+", t) and not t.startswith(CONFIG_SECTIONS)
            and not re.search(r"\.(py|mjs|md|yaml|json|pt)$", t)]
    checked, missing = 0, []
    for ref in refs:
        parts = ref.split(".")
        if parts[0] != "prunelight" and f"prunelight.{parts[0]}" not in MODULES:
            continue  # not a module reference (a YAML key, a field)
        if parts[0] == "prunelight":
            parts = parts[1:]
        # the longest prefix that is a module, then attributes
        for cut in range(len(parts), -1, -1):
            module = ".".join(["prunelight", *parts[:cut]])
            if module in MODULES or cut == 0:
                break
        obj = importlib.import_module(module)
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            missing.append(ref)
        checked += 1
    assert checked > 30 and missing == []


@pytest.mark.parametrize("module", ["plan.py", "pipeline.py", "cut.py", "model_tuning.py"])
def test_the_core_cut_modules_name_no_allocation(module):
    """Whoever changes the plan, the pipeline, the cut or the model tuning need not learn any allocation."""
    text = (PACKAGE / module).read_text().lower()
    named = [name for name in ALLOCATIONS if re.search(rf"\b{name}\b", text)]
    assert named == []
