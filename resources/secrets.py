"""Secret fields configured as `dagster.EnvVar`: read outside a Dagster run, they are resolved here."""

from __future__ import annotations

from typing import Any

from dagster import EnvVar


def resolved(value: Any) -> Any:
    """The value itself. Inside a run Dagster has already resolved an EnvVar field to its value; outside
    one (the demo, a command calling `defs.resources[...]` directly) the field is still the EnvVar."""
    return value.get_value() if isinstance(value, EnvVar) else value
