"""What the code server's forkserver loads once, before the first run's process is forked from it
(orchestration.code_server): Dagster's run entry point, the instance's PostgreSQL storage, the code location and
its built Definitions. Nothing here connects or starts a thread: each fork opens its own connections."""

import dagster._grpc.impl  # noqa: F401 - the target a run's process starts with
import dagster_postgres  # noqa: F401 - the run, event log and schedule storage every run writes
import httpcore  # noqa: F401 - httpx imports its transport when a run opens its first client (3 % of a file job's CPU)

import orchestration.storage  # noqa: F401 - the instance's storage class (dagster.yaml)

from orchestration import definitions

definitions.prebuild()
