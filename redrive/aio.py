"""Objects that live as long as one event loop: a drain run's async HTTP clients.

An async client is bound to the loop it was made on, and a drain run is one loop (`asyncio.run`), so a
process-wide client would outlive its loop. Resources ask for theirs here, made once per loop; the run
closes them when its loop ends. Core code, so resources may use it without the core knowing them.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

_LOCALS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, tuple[Any, Callable[[Any], Awaitable[None]]]]]
_LOCALS = weakref.WeakKeyDictionary()


def loop_local(key: str, make: Callable[[], T], aclose: Callable[[T], Awaitable[None]]) -> T:
    """The running loop's object under `key`, made by `make()` the first time."""
    loop = asyncio.get_running_loop()
    mine = _LOCALS.setdefault(loop, {})
    if key not in mine:
        mine[key] = (make(), aclose)
    return mine[key][0]


async def close_loop_locals() -> None:
    """Close what this loop made (the end of a drain run)."""
    mine = _LOCALS.pop(asyncio.get_running_loop(), {})
    for value, aclose in mine.values():
        await aclose(value)
