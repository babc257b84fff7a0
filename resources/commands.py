"""What every pipeline's operator command shares: its database for one command, and the one-line error.

No Dagster here: `redrive review status`, `redrive matching stuck`, `redrive evidence show` … answer without
loading the orchestrator.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

import sqlalchemy as sa
import typer


@contextmanager
def engine() -> Iterator[sa.Engine]:
    """DATABASE_URL, or the embedded server started (and stopped) for this one command."""
    from redrive.db import engine_for
    from redrive.settings import Settings
    from resources.postgres import database_session

    with database_session(Settings()) as url:
        yield engine_for(url)


def fail(message: str) -> NoReturn:
    """A command's canonical error: one line on stderr, exit status 2, never a stack trace."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)
