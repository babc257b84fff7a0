"""A run's log lines in the process's log format: the `console` logger of every job when logs are JSON.

Dagster's default console logger writes its own text lines; a run's `context.log` calls reach only the
job's loggers, not the root logger :func:`redrive.logs.configure` set up. With REDRIVE_LOG_FORMAT=json
the Definitions use this logger instead, so a run worker's lines are JSON too, with the run id, job and
step Dagster knows and the fields the core passes as ``extra=`` (pipeline, entity, stage, attempt, …).
"""

from __future__ import annotations

import logging

import dagster as dg

from redrive import logs


@dg.logger(
    config_schema={"log_level": dg.Field(str, is_required=False, default_value="INFO")},
    description="Run log lines in REDRIVE_LOG_FORMAT (JSON in a deployment), every field redacted.",
)
def redrive_console_logger(init_context: dg.InitLoggerContext) -> logging.Logger:
    logger = logging.Logger("redrive.run", level=init_context.logger_config["log_level"].upper())
    handler = logs.stderr_handler()
    handler.setFormatter(logs.formatter(logs.log_format()))
    logger.addHandler(handler)
    return logger


def default_loggers() -> dict[str, dg.LoggerDefinition]:
    """The Definitions' default loggers: ours for JSON, Dagster's own console logger otherwise."""
    return {"console": redrive_console_logger} if logs.log_format() == "json" else {}
