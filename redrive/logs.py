"""Every log record of the process is redacted when it is made, whoever logs it.

A logger's filter sees only its own records, and a handler's only what reaches that
handler; third-party loggers (httpx logs full URLs, query tokens included) reach
handlers we do not own (Dagster's, pytest's). A record factory is the one place all
records pass, so redaction happens there, once, before any handler formats them.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redrive.sanitize import SanitizingFilter


@cache
def _filter() -> SanitizingFilter:
    """Built with the first record: the sanitizer's patterns cost a command that logs nothing (`redrive --help`)."""
    from redrive.sanitize import SanitizingFilter

    return SanitizingFilter()


def install() -> None:
    """Idempotent; called when the code location, a command or the test session starts."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "redrive_sanitizing", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        _filter().filter(record)
        return record

    factory.redrive_sanitizing = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
