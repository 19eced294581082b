"""Print the resolved versions of the packages prunelight's surgery, training and evaluation depend on.

CI prints this at the top of its log so that a break caused by a new upstream release names its cause:
    python scripts/print_versions.py
"""
from __future__ import annotations

import platform
import sys
from importlib.metadata import PackageNotFoundError, version

# The libraries whose internals prunelight touches or whose APIs it drives, in the order a reader looks for them.
PACKAGES = ("torch", "transformers", "lightning", "peft", "lm_eval", "jsonargparse", "deepspeed", "optuna",
            "sqlalchemy", "psycopg", "datasets", "torchmetrics", "safetensors", "accelerate", "gguf", "numpy")


def resolved_versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str]:
    """Installed version of each package, or 'not installed'."""
    found = {}
    for name in packages:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


def main() -> None:
    """Print one aligned line per package, after the Python version."""
    print(f"python       {platform.python_version()} ({sys.executable})")
    for name, v in resolved_versions().items():
        print(f"{name:<12} {v}")


if __name__ == "__main__":
    main()
