"""Plain HTTP services, and the connection pools every per-call HTTP client of a process shares.

`httpx.post(...)` builds a client per call: a fresh TLS context (the CA bundle parsed again) and a new
TCP connection every time. Profiled in the criticizer's drain that was 61 % of a worker thread's time.
Pooled clients per process keep connections alive and pay for TLS set-up once; httpx clients are
thread-safe, and timeouts are passed per request, so every caller keeps its own. A coroutine handler's
calls share the async clients of their event loop (a drain run's), closed with the run.

Several small pools taken in turn, not one large one: httpcore's pool walks all its connections twice a
request, polling each one's socket and, for each idle one, counting them all again (encode/httpcore#1035,
open). A thread-safe pool does it under its lock. At 64 calls in flight on a 50 ms upstream, one async pool
spent 9.4 ms of CPU a request and capped its process near 105 requests/s; eight pools spent 0.7 ms and
made 1,100 a second. Every pool shares one TLS context.
"""

from __future__ import annotations

import itertools
import os
import ssl
import threading
from collections.abc import Callable, Iterator
from functools import lru_cache
from typing import Generic, TypeVar

import httpx
from dagster import ConfigurableResource

from redrive import aio
from redrive.upstreams import guarded

POOLS = 8  # with hundreds in flight each pool still holds tens of connections; a pool costs a few kB idle
C = TypeVar("C", httpx.Client, httpx.AsyncClient)


class Pools(Generic[C]):
    """Clients handed out in turn, one per request, so each one's pool holds a share of the connections.

    Each pool keeps its share of `keepalive` alive (twice it, as turns are not even when answers are not),
    and may open up to all of `connections` for a burst: a request never waits on a pool while another has
    room, and what bounds the calls in flight stays the caller's (its threads, slots, limiter)."""

    def __init__(self, make: Callable[[httpx.Limits, ssl.SSLContext], C], connections: int, keepalive: int,
                 pools: int = POOLS) -> None:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=2 * -(-keepalive // pools))
        self.clients = [make(limits, _tls()) for _ in range(pools)]
        self._turn: Iterator[C] = itertools.cycle(self.clients)  # a C iterator: one `next` is atomic

    def next(self) -> C:
        return next(self._turn)

    def close(self) -> None:
        for client in self.clients:
            client.close()  # type: ignore[union-attr]

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()  # type: ignore[union-attr]


@lru_cache(maxsize=1)
def _tls() -> ssl.SSLContext:
    """httpx's default verifying context, built once (each client would parse the CA bundle again)."""
    return httpx.create_ssl_context()


def client_pools(in_flight: int, timeout: float = 10.0) -> Pools[httpx.Client]:
    """Thread-safe clients for a worker's `in_flight` calls at once and a probe (its own, closed with it):
    that many connections kept alive, never fewer than httpx's defaults (20 kept, 100 at once)."""
    keep = max(20, in_flight + 1)
    return Pools(lambda limits, tls: httpx.Client(limits=limits, timeout=timeout, verify=tls), max(100, keep), keep)


_LOCK = threading.Lock()
_SHARED: tuple[int, Pools[httpx.Client]] | None = None


def shared_client() -> httpx.Client:
    """One of this process's pooled clients, for one request (a forked child makes its own: sockets are not
    shared across a fork)."""
    global _SHARED
    current = _SHARED
    if current is None or current[0] != os.getpid():
        with _LOCK:
            if _SHARED is None or _SHARED[0] != os.getpid():
                _SHARED = (os.getpid(), Pools(lambda limits, tls: httpx.Client(limits=limits, timeout=10.0,
                                                                                 verify=tls), 200, 64))
            current = _SHARED
    return current[1].next()


def async_pools() -> Pools[httpx.AsyncClient]:
    """The running loop's async clients, made with its first request and closed with it."""
    return aio.loop_local("httpx", lambda: Pools(lambda limits, tls: httpx.AsyncClient(
        limits=limits, timeout=10.0, verify=tls), 1000, 256), lambda pools: pools.aclose())


def shared_async_client() -> httpx.AsyncClient:
    """One of the running loop's pooled async clients, for one request: a drain run's hundreds of entities in
    flight share them."""
    return async_pools().next()


class ArtifactStoreResource(ConfigurableResource):
    """GET an artifact by path; a non-2xx answer raises `httpx.HTTPStatusError` for the classifier."""

    base_url: str
    timeout_seconds: float = 10.0

    def fetch(self, path: str) -> bytes:
        url = f"{self.base_url.rstrip('/')}/{path.lstrip('/')}"
        response = guarded("artifact_store", lambda: shared_client().get(url, timeout=self.timeout_seconds))
        response.raise_for_status()
        return response.content
