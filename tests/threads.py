"""How many OS threads a test's process gains while it works (issue 26 §2: an entity waiting on an upstream holds
none of its own), and sampling real processes while a block runs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import psutil


@contextlib.contextmanager
def sampled(sample: Callable[[], None], every: float) -> Iterator[None]:
    """Calls `sample()` every `every` seconds on a thread of its own while the block runs."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(every):
            sample()

    sampler = threading.Thread(target=loop, daemon=True)
    sampler.start()
    try:
        yield
    finally:
        stop.set()
        sampler.join(5)


@contextlib.contextmanager
def thread_growth() -> Iterator[list[int]]:
    """Yields [growth]: the most threads this process had above its count at the start, sampled every 50 ms;
    final once the block ends."""
    me = psutil.Process()
    before, peak, growth = me.num_threads(), [me.num_threads()], [0]

    def watch() -> None:
        peak[0] = max(peak[0], me.num_threads())

    try:
        with sampled(watch, 0.05):
            yield growth
    finally:
        growth[0] = peak[0] - before
