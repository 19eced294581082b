"""Code-size metrics of the package (ast-based): long modules, long functions, import circles, function-level imports.

    python scripts/code_metrics.py [package_dir]

Import circles are counted on module-level imports only (`prunelight.x` -> `prunelight.y`, a package's
`__init__` standing for its folder's import), as strongly connected components of more than one module.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """Dotted module name of a file under the package root."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(tree: ast.Module, name: str, is_pkg: bool, top_level: bool) -> set[str]:
    """prunelight modules imported at module level (top_level) or inside functions (not top_level)."""
    out: set[str] = set()
    funcs = (ast.FunctionDef, ast.AsyncFunctionDef)
    nodes = tree.body if top_level else [n for f in ast.walk(tree) if isinstance(f, funcs) for n in ast.walk(f)]
    if top_level:  # module level includes imports under if/try at the top, not under TYPE_CHECKING
        nodes = [n for stmt in tree.body if not (isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.unparse(stmt.test))
                 for n in ast.walk(stmt) if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        nodes += [n for stmt in tree.body if isinstance(stmt, ast.ClassDef) for n in stmt.body
                  if isinstance(n, (ast.Import, ast.ImportFrom))]
    base = name if is_pkg else name.rpartition(".")[0]
    for n in nodes:
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names if a.name.startswith("prunelight")}
        elif isinstance(n, ast.ImportFrom):
            mod = n.module or ""
            if n.level:
                pkg = base.split(".")
                pkg = pkg[: len(pkg) - (n.level - 1)]
                mod = ".".join(pkg + ([mod] if mod else []))
            if mod.startswith("prunelight"):
                out.add(mod)
                out |= {f"{mod}.{a.name}" for a in n.names}
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def main(root: Path) -> None:
    """Print the metrics for the package at `root`."""
    files = sorted(root.rglob("*.py"))
    names = {module_name(p, root): p for p in files}
    long_modules, long_functions, graph, local_imports = [], [], {}, 0
    for name, path in names.items():
        text = path.read_text()
        tree = ast.parse(text)
        lines = len(text.splitlines())
        if lines > 400:
            long_modules.append((lines, name))
        for f in ast.walk(tree):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = f.end_lineno - f.lineno + 1
                if n > 60:
                    long_functions.append((n, f"{name}.{f.name}"))
        is_pkg = path.name == "__init__.py"
        targets = imports(tree, name, is_pkg, top_level=True)
        graph[name] = {t for t in targets if t in names and t != name}
        local_imports += sum(1 for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                             for n in ast.walk(f) if _own_import(n))
    # Function-level imports close circles at run time: count the circles with them too.
    full = {k: set(v) for k, v in graph.items()}
    for name, path in names.items():
        tree = ast.parse(path.read_text())
        full[name] |= {t for t in imports(tree, name, path.name == "__init__.py", top_level=False)
                       if t in names and t != name}
    print(f"modules over 400 lines: {len(long_modules)}  {sorted(long_modules, reverse=True)}")
    print(f"functions over 60 lines: {len(long_functions)}  {sorted(long_functions, reverse=True)}")
    print(f"import circles (module level): {len(circles(graph))}  {circles(graph)}")
    print(f"import circles (with function-level imports): {len(circles(full))}  "
          f"{circles(full)}")
    print(f"function-level prunelight imports: {local_imports}")
    refusals = ratio_refusals(names)
    print(f"ratio refusals (raise naming the ratio, a budget or the asked target): {len(refusals)} raises in "
          f"{len({f for f, _ in refusals})} functions  {sorted({f for f, _ in refusals})}")


def _own_import(n: ast.AST) -> bool:
    """An import of a prunelight module (absolute or relative)."""
    if isinstance(n, ast.ImportFrom):
        return bool(n.level) or (n.module or "").startswith("prunelight")
    return isinstance(n, ast.Import) and any(a.name.startswith("prunelight") for a in n.names)


RATIO = re.compile(r"\bratio\b|budget|\basked\b", re.IGNORECASE)


def ratio_refusals(names: dict[str, Path]) -> list[tuple[str, int]]:
    """(function, line) of every `raise` whose message names the ratio, a budget or the asked target."""
    out = []
    for name, path in names.items():
        src = path.read_text()
        tree = ast.parse(src)
        for f in ast.walk(tree):
            if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for n in ast.walk(f):
                text = ast.get_source_segment(src, n.exc) or "" if isinstance(n, ast.Raise) and n.exc else ""
                if RATIO.search(text):
                    out.append((f"{name}.{f.name}", n.lineno))
    return sorted(set(out))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "prunelight"))
