"""`make bench`: run every benchmark module in bench/ under the local stack, one after another.

Each module has a `main() -> int` that prints its own figures and their ratio against a
baseline measured in the same session. `python -m bench NAME` runs just one, and
`python -m bench NAME --option …` passes the options to its `main(argv)`. A module with
`IN_MAKE_BENCH = False` (the chaos run, `make chaos`) runs only when named.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import signal
import sys
from pathlib import Path

from devstack.stack import local_stack


def modules() -> list[str]:
    here = Path(__file__).parent
    names = sorted(m.name for m in pkgutil.iter_modules([str(here)]) if not m.name.startswith("_"))
    return [n for n in names if getattr(importlib.import_module(f"bench.{n}"), "IN_MAKE_BENCH", True)]


def main(argv: list[str]) -> int:
    if len(argv) > 1 and argv[1].startswith("-"):
        names, argv = argv[:1], argv[1:]
    else:
        names, argv = argv or modules(), []
    status = 0
    # Ctrl-C or SIGTERM stops the stack and the deployment it started, also when started in the background
    # (where SIGINT is ignored and SIGTERM would end this process and leave its children behind)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # the sandbox stands for providers on machines of their own: in real time, ahead of our run processes for this
    # 2-core box's cores, so its meters count what we sent, not what its stalled loop bunched (devstack.sandbox.prioritized)
    os.environ.setdefault("SANDBOX_PRIORITY", "realtime")
    # the chaos run restarts its PostgreSQL: a server of its own, not the one the demo and benchmarks share
    with local_stack("chaos" if names == ["chaos"] else "bench"):
        for name in names:
            print(f"=== bench.{name}", flush=True)
            module = importlib.import_module(f"bench.{name}")
            status |= int((module.main(argv) if argv else module.main()) or 0)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
