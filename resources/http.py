"""Plain HTTP services, and the one connection pool every per-call HTTP client of a process shares.

`httpx.post(...)` builds a client per call: a fresh TLS context (the CA bundle parsed again) and a new
TCP connection every time. Profiled in the criticizer's drain that was 61 % of a worker thread's time.
One pooled client per process keeps connections alive and pays for TLS set-up once; httpx clients are
thread-safe, and timeouts are passed per request, so every caller keeps its own. A coroutine handler's
calls share one async client per event loop (a drain run's), closed with the run.
"""

from __future__ import annotations

import os
import threading

import httpx
from dagster import ConfigurableResource

from redrive import aio
from redrive.upstreams import guarded

_LOCK = threading.Lock()
_CLIENT: tuple[int, httpx.Client] | None = None


def shared_client() -> httpx.Client:
    """This process's pooled client (a forked child makes its own: sockets are not shared across a fork)."""
    global _CLIENT
    current = _CLIENT
    if current is not None and current[0] == os.getpid():
        return current[1]
    with _LOCK:
        if _CLIENT is None or _CLIENT[0] != os.getpid():
            limits = httpx.Limits(max_connections=200, max_keepalive_connections=64)
            _CLIENT = (os.getpid(), httpx.Client(limits=limits, timeout=10.0))
        return _CLIENT[1]


def shared_async_client() -> httpx.AsyncClient:
    """The running loop's pooled async client: a drain run's hundreds of entities in flight share it."""
    return aio.loop_local("httpx", lambda: httpx.AsyncClient(
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=256), timeout=10.0),
        lambda client: client.aclose())


class ArtifactStoreResource(ConfigurableResource):
    """GET an artifact by path; a non-2xx answer raises `httpx.HTTPStatusError` for the classifier."""

    base_url: str
    timeout_seconds: float = 10.0

    def fetch(self, path: str) -> bytes:
        url = f"{self.base_url.rstrip('/')}/{path.lstrip('/')}"
        response = guarded("artifact_store", lambda: shared_client().get(url, timeout=self.timeout_seconds))
        response.raise_for_status()
        return response.content
