"""A real sandbox process for the session; each test starts from a reset one."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from devstack.sandbox import SandboxClient, SandboxProcess


@pytest.fixture(scope="session")
def sandbox() -> Iterator[SandboxClient]:
    """`python -m devstack.sandbox --port 0` as a subprocess, reached over the network."""
    with SandboxProcess.start() as process, process.client() as client:
        yield client


@pytest.fixture(autouse=True)
def _fresh_sandbox(sandbox: SandboxClient) -> None:
    sandbox.reset()


@pytest.fixture
def http(sandbox: SandboxClient) -> Iterator[httpx.Client]:
    """A plain HTTP client aimed at the sandbox, as a pipeline's resource would be."""
    with httpx.Client(base_url=sandbox.base_url, timeout=5) as client:
        yield client

