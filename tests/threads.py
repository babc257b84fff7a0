"""How many OS threads a test's process gains while it works (issue 26 §2: an entity waiting on an upstream holds
none of its own)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import psutil


@contextlib.contextmanager
def thread_growth() -> Iterator[list[int]]:
    """Yields [growth]: the most threads this process had above its count at the start, sampled every 50 ms;
    final once the block ends."""
    me = psutil.Process()
    before, peak, stop = me.num_threads(), [me.num_threads()], threading.Event()

    def watch() -> None:
        while not stop.wait(0.05):
            peak[0] = max(peak[0], me.num_threads())

    growth = [0]
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield growth
    finally:
        stop.set()
        watcher.join(5)
        growth[0] = peak[0] - before
