"""Fixtures of the retention and counter tests: the evidence and conversion pipelines' own, on one frozen clock."""

from __future__ import annotations

from tests.conversion.conftest import conv_settings, files, make_worker, reliability, submit  # noqa: F401
from tests.evidence.conftest import case_api, clock, drain, runtime, seed_job  # noqa: F401
