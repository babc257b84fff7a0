"""Run one matchmaking partition in this process, as a Dagster run worker would (SIGKILL and race tests).

Usage: python -m tests.matchmaking.run_partition PARTITION_KEY [GO_FILE]
Settings come from the environment (DATABASE_URL, MATCHMAKING_*, REDRIVE_TIME_SCALE). With GO_FILE,
it prints "ready" once definitions are loaded and starts when the file appears, so two processes
start together. Prints "started <t>" and "ended <t> <status>" in wall-clock seconds.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    key = sys.argv[1]
    go_file = sys.argv[2] if len(sys.argv) > 2 else None
    import dagster as dg

    from orchestration import registry

    registry.PIPELINES = registry.selected(["matchmaking"])
    from orchestration.definitions import build_definitions
    from redrive.settings import Settings

    job = build_definitions(Settings()).resolve_job_def("matchmaking_job")
    print("ready", flush=True)
    while go_file and not os.path.exists(go_file):
        time.sleep(0.005)
    print(f"started {time.time()}", flush=True)
    with dg.DagsterInstance.ephemeral() as instance:
        result = job.execute_in_process(partition_key=key, instance=instance, raise_on_error=False)
    print(f"ended {time.time()} {'success' if result.success else 'failure'}", flush=True)
    return 0 if result.success else 1


if __name__ == "__main__":
    sys.exit(main())
