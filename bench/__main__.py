"""`make bench`: run every benchmark module in bench/ under the local stack, one after another.

Each module has a `main() -> int` that prints its own figures and their ratio against a
baseline measured in the same session. `python -m bench NAME` runs just one.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

from devstack.stack import local_stack


def modules() -> list[str]:
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)]) if not m.name.startswith("_"))


def main(argv: list[str]) -> int:
    names = argv or modules()
    status = 0
    with local_stack("bench"):
        for name in names:
            print(f"=== bench.{name}", flush=True)
            module = importlib.import_module(f"bench.{name}")
            status |= int(module.main() or 0)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
