"""Every log record of the process is redacted when it is made, whoever logs it.

A logger's filter sees only its own records, and a handler's only what reaches that
handler; third-party loggers (httpx logs full URLs, query tokens included) reach
handlers we do not own (Dagster's, pytest's). A record factory is the one place all
records pass, so redaction happens there, once, before any handler formats them.
"""

from __future__ import annotations

import logging
from typing import Any

from redrive.sanitize import SanitizingFilter

_FILTER = SanitizingFilter()


def install() -> None:
    """Idempotent; called when the code location, a command or the test session starts."""
    previous = logging.getLogRecordFactory()
    if getattr(previous, "redrive_sanitizing", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        _FILTER.filter(record)
        return record

    factory.redrive_sanitizing = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)
