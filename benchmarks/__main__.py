"""`python -m benchmarks [NAME [ARGS]]`: list the benchmarks, or run one (its `main(ARGS)`)."""

from __future__ import annotations

import ast
import importlib
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def catalogue() -> dict[str, tuple[str, str]]:
    """name -> (what it measures, what it writes) of every benchmark, read from the source (nothing is imported)."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        if path.name.startswith("_"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        writes = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
                  and any(getattr(t, "id", None) == "WRITES" for t in node.targets)
                  and isinstance(node.value, ast.Constant)]
        found[path.stem] = ((ast.get_docstring(tree) or "").split("\n", 1)[0], writes[0] if writes else "")
    return found


def usage(found: dict[str, tuple[str, str]]) -> str:
    """The help text: the entry point, then each benchmark with what it measures and writes."""
    width = max(map(len, found), default=0)
    lines = ["usage: python -m benchmarks NAME [ARGS]   (python -m benchmarks NAME --help: its options)", "",
             "Benchmarks (each regenerates a table of README.md or docs/; results under results/):", ""]
    for name, (what, writes) in found.items():
        lines += [f"  {name:<{width}}  {what}", f"  {'':<{width}}  writes {writes or '(see its --help)'}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """List the benchmarks (no NAME, -h, --help) or run one; its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    found = catalogue()
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(found))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in found:
        print(f"python -m benchmarks: {name!r} is not a benchmark; use one of {', '.join(found)}", file=sys.stderr)
        return 2
    # offline and quiet by default: every benchmark reads local models and data
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return importlib.import_module(f"benchmarks.{name}").main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
