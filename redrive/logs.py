"""Every log record of the process is redacted when it is made, and one switch makes every line JSON.

A logger's filter sees only its own records, and a handler's only what reaches that
handler; third-party loggers (httpx logs full URLs, query tokens included) reach
handlers we do not own (Dagster's, pytest's). A record factory is the one place all
records pass, so the message is redacted there, once, before any handler formats them.
Fields given as ``extra=`` are set on the record after the factory ran, so the JSON
formatter redacts every field again as it writes the line.

``REDRIVE_LOG_FORMAT=json`` (the deployed topology's default) or ``text`` (a terminal's):
:func:`configure` gives the root logger one stderr handler in that format, in every process
that loads redrive — the code server, run workers, the conversion API and workers, the CLI.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from functools import cache
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from redrive.sanitize import SanitizingFilter

FORMAT_ENV = "REDRIVE_LOG_FORMAT"
LEVEL_ENV = "REDRIVE_LOG_LEVEL"
FORMATS = ("json", "text")
# What a line says about the work it is about, when the logger knows it (pass them as `extra=fields(...)`).
FIELDS = ("pipeline", "entity", "stage", "attempt", "error_class", "run_id")

_HANDLER_MARK = "redrive_handler"


@cache
def _filter() -> SanitizingFilter:
    """Built with the first record: the sanitizer's patterns cost a command that logs nothing (`redrive --help`)."""
    from redrive.sanitize import SanitizingFilter

    return SanitizingFilter()


def sanitize_context(values: Mapping[str, Any]) -> dict[str, Any]:
    from redrive.sanitize import sanitize_context as redact

    return redact(values)


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


def fields(**values: Any) -> dict[str, Any]:
    """The known context of a line, for ``extra=``; unknown (None) fields are left out."""
    return {k: v for k, v in values.items() if v is not None}


STANDARD_ATTRIBUTES = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a record carries beyond the standard ones (its ``extra=``)."""
    return {k: v for k, v in record.__dict__.items() if k not in STANDARD_ATTRIBUTES}


def _json_formatter() -> logging.Formatter:
    from pythonjsonlogger.json import JsonFormatter

    class RedactingJsonFormatter(JsonFormatter):
        """python-json-logger's formatter; every field redacted (extra fields skip the record factory)."""

        def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
            meta = log_data.pop("dagster_meta", None)
            if isinstance(meta, Mapping):  # a Dagster run's line: its run, job and step, and the op's own words
                for key, name in (("run_id", "run_id"), ("job_name", "job"), ("step_key", "step")):
                    if meta.get(key) and name not in log_data:
                        log_data[name] = meta[key]
                if meta.get("orig_message"):
                    log_data["message"] = meta["orig_message"]
                event = meta.get("dagster_event")
                if getattr(event, "event_type_value", None):
                    log_data["dagster_event"] = event.event_type_value
            return sanitize_context(log_data)

    return RedactingJsonFormatter("{levelname}{name}{message}", style="{", json_default=str, timestamp="ts",
                                  rename_fields={"levelname": "level", "name": "logger", "exc_info": "exception"})


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at the time (a test's capture ends; the process's stderr stays)."""

    @property  # type: ignore[override]
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def stderr_handler() -> logging.Handler:
    return _Stderr()


class _TextFormatter(logging.Formatter):
    """A terminal's line: time, level, logger, message, then the record's fields as key=value (redacted)."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = sanitize_context({k: v for k, v in record_fields(record).items() if k != "dagster_meta"})
        return " ".join([line, *(f"{k}={v}" for k, v in extra.items())]) if extra else line


def formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return _json_formatter()
    return _TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


def line(message: str, name: str = "redrive") -> str:
    """A service's one-off line (its "serving …"): one JSON record in JSON mode, else the text as it is."""
    if log_format() != "json":
        return message
    return formatter("json").format(logging.LogRecord(name, logging.INFO, __file__, 0, message, None, None))


def run_log_handler() -> logging.Handler:
    """For dagster.yaml's `python_logs.dagster_handler_config`: every run's log lines (`context.log`, Dagster's
    events) in JSON on stderr when REDRIVE_LOG_FORMAT=json; nothing otherwise (then Dagster's console logger writes
    its text lines; in JSON mode :func:`one_line_per_run_record` leaves that logger out). Runs see it whatever their
    run config says about loggers."""
    if log_format() != "json":
        return logging.NullHandler()
    handler = _Stderr()
    handler.setLevel(logging.INFO)
    handler.setFormatter(formatter("json"))
    return handler


RUN_HANDLER = f"{__name__}.run_log_handler"


def _run_lines_are_json(instance: Any) -> bool:
    """True where this process writes JSON and the instance's dagster.yaml hands run records to run_log_handler."""
    if instance is None or log_format() != "json":
        return False
    handlers = (instance.get_python_log_dagster_handler_config() or {}).get("handlers") or {}
    return any(isinstance(h, Mapping) and h.get("()") == RUN_HANDLER for h in handlers.values())


def one_line_per_run_record() -> None:
    """Idempotent; the code location calls it, so every run worker has it. A run whose run config names no
    `loggers` gets Dagster's coloured console logger (`default_system_loggers`), which prints every record as
    text beside run_log_handler's JSON line: two lines per record. Dagster offers no setting for it short of a
    `loggers:` entry in every run's config (sensors, backfills, the launchpad, retries), so where run_log_handler
    writes JSON the default console logger is left out; text mode, or an instance without our handler, keeps it.
    A sensor's or schedule's lines (the code server's) are JSON in JSON mode too.
    """
    try:
        from dagster._core.definitions import instigation_logger
        from dagster._core.execution import context_creation_job, host_mode

        _one_line(instigation_logger, (context_creation_job, host_mode))
    except (ImportError, AttributeError):  # a Dagster that moved them: lines may come twice, the code location loads
        logging.getLogger(__name__).warning("this Dagster has no default_system_loggers or create_console_logger "
                                            "where redrive expects them; run and sensor lines may print twice")


def _one_line(instigation_logger: Any, run_modules: tuple[Any, ...]) -> None:
    # a sensor's or schedule's `context.log` (the code server's lines) goes to a console logger Dagster builds
    # for each tick: in JSON mode, one whose line is ours
    if not getattr(instigation_logger.create_console_logger, "redrive_one_line", False):
        dagster_console = instigation_logger.create_console_logger

        def create_console_logger(name: str, level: Any, _dagster_console: Any = dagster_console) -> logging.Logger:
            if log_format() != "json":
                return _dagster_console(name, level)
            console = logging.Logger(name, level=level)  # not registered, as Dagster's is not
            console.addHandler(run_log_handler())
            return console

        create_console_logger.redrive_one_line = True  # type: ignore[attr-defined]
        instigation_logger.create_console_logger = create_console_logger  # type: ignore[attr-defined]
    for module in run_modules:
        dagster_default = module.default_system_loggers
        if getattr(dagster_default, "redrive_one_line", False):
            continue

        def default_system_loggers(instance: Any, _dagster_default: Any = dagster_default) -> Any:
            return [] if _run_lines_are_json(instance) else _dagster_default(instance)

        default_system_loggers.redrive_one_line = True  # type: ignore[attr-defined]
        module.default_system_loggers = default_system_loggers  # type: ignore[attr-defined]


# Third-party loggers whose INFO lines repeat on every call (botocore: "Found credentials in environment
# variables." each time a client is made, every sensor tick; alembic: its plugins at each upgrade).
QUIET_LOGGERS = ("botocore.credentials", "alembic.runtime.plugins", "alembic.runtime.migration", "httpx")


def _not_written_below_root(record: logging.LogRecord) -> bool:
    """False for a record a handler of its own logger chain already wrote (Dagster's loggers have their own
    handler, in the format `--log-format` gave them): one line per record, not the same line twice."""
    logger: logging.Logger | None = logging.getLogger(record.name)
    while logger is not None and logger.parent is not None:  # up to, not including, the root
        if any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
            return False
        if not logger.propagate:
            break
        logger = logger.parent
    return True


def log_format(env: Mapping[str, str] | None = None) -> str:
    """The configured format; an unknown value is a configuration error, said at start-up."""
    value = (env if env is not None else os.environ).get(FORMAT_ENV, "text").strip().lower() or "text"
    if value not in FORMATS:
        raise ValueError(f"{FORMAT_ENV} must be one of {', '.join(FORMATS)}, got {value!r}")
    return value


def configure(fmt: str | None = None, *, stream: IO[str] | None = None, level: int | str | None = None,
              default_level: str = "INFO", replace: bool = True, only_if_set: bool = False) -> logging.Handler | None:
    """Redaction plus one root handler in the configured format; calling it again replaces the handler.

    The level is ``level``, else REDRIVE_LOG_LEVEL, else ``default_level`` (an operator's command says
    only warnings; a service says what it does). ``replace=False`` keeps a configuration the process's
    entry point already made (the code location loaded inside `redrive demo` keeps the command's).
    ``only_if_set``: without REDRIVE_LOG_FORMAT in the environment, only redact (a terminal's command and
    the code location inside a test or the demo keep their quiet defaults); a deployment sets it.
    """
    install()
    if only_if_set and fmt is None and not os.environ.get(FORMAT_ENV):
        return None
    fmt = fmt or log_format()
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]
    if ours and not replace:
        return ours[0]
    for old in ours:
        root.removeHandler(old)
    handler = logging.StreamHandler(stream) if stream is not None else _Stderr()
    setattr(handler, _HANDLER_MARK, True)
    handler.setFormatter(formatter(fmt))
    handler.addFilter(_not_written_below_root)
    root.addHandler(handler)
    for name in QUIET_LOGGERS:  # a line per call of theirs at INFO says nothing an operator needs
        logging.getLogger(name).setLevel(logging.WARNING)
    wanted = level if level is not None else os.environ.get(LEVEL_ENV, default_level)
    root.setLevel(wanted.upper() if isinstance(wanted, str) else wanted)
    return handler
