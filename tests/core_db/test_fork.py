"""A forked process (Dagster's forkserver forks every run worker) opens its own connections and leaves its
parent's alone: `redrive.db.per_process` engines, the write pool's and the limiter's."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from redrive.db import engine_for
from redrive.upstreams import limiter_engine

BACKEND = sa.text("SELECT pg_backend_pid()")


def _in_child(work: Callable[[], object]) -> object:
    """`work()` in a forked child; its JSON result, or the child's error as text."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            try:
                out = {"ok": work()}
            except BaseException as exc:  # the parent reports it
                out = {"error": repr(exc)}
            os.write(write, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        body = pipe.read()
    os.waitpid(pid, 0)
    out = json.loads(body)
    assert "error" not in out, out.get("error")
    return out["ok"]


@pytest.mark.parametrize("make", [engine_for, lambda url: limiter_engine(sa.make_url(url))],
                         ids=["write pool", "limiter"])
def test_a_forked_child_uses_a_backend_of_its_own_and_the_parents_stays_open(db_url: str, make) -> None:
    parent = make(db_url)
    with parent.connect() as conn:
        pooled = conn.scalar(BACKEND)  # returned to the pool, open, when the block ends

    def child() -> list[object]:
        engine = make(db_url)
        with engine.connect() as conn:
            return [engine is parent, conn.scalar(BACKEND)]

    same_engine, child_backend = _in_child(child)
    assert same_engine is False
    assert child_backend != pooled
    # the child neither used nor closed the parent's pooled connection: the parent's next checkout is that backend
    with parent.connect() as conn:
        assert conn.scalar(BACKEND) == pooled
    assert make(db_url) is parent
