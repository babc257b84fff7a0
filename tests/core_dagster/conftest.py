"""The rehearsal pipeline's request, for the core's Dagster tests."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from assets.rehearsal import repository
from tests.conftest import TIME_SCALE  # noqa: F401 - re-exported for the tests here


@pytest.fixture
def rehearsal_request(engine: sa.Engine, sandbox):
    """One request whose artifact is in the sandbox store; returns its id."""
    sandbox.put_store("docs/contract.txt", b"The parties agree to everything.", "text/plain")
    with engine.begin() as conn:
        repository.create(conn, "req-1", "docs/contract.txt", "Is this contract fair?")
    return "req-1"
