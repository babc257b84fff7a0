"""A deliverer that dies the hard way right after the provider accepted a send (the §8.2 row 1 window).

    python -m tests.review_notifications.crash_worker DATABASE_URL JOB_KEY CRASH_AT

Runs a real pass over the job and calls `os._exit(CRASHED)` from the send-and-mark test seam when
the CRASH_AT-th send has been accepted: no `finally`, no rollback handler, no mark write.
"""

from __future__ import annotations

import os
import sys

from assets.review_notifications import repository
from assets.review_notifications.delivery import Deliverer
from redrive.db import engine_for
from redrive.reliability import Reliability
from resources.review_notifications import MailProvider

CRASHED = 86


class CrashAfter:
    def __init__(self, n: int) -> None:
        self.left = n

    def after_provider_accept(self, delivery_id: int, message_id: str) -> None:
        self.left -= 1
        if self.left == 0:
            os._exit(CRASHED)


def main(url: str, key: str, crash_at: int) -> int:
    engine = engine_for(url)
    with engine.connect() as conn:
        job = repository.job_by_key(conn, key)
    with MailProvider(f"{os.environ['SANDBOX_URL']}/mail/v1", "sandbox-token") as mail:
        Deliverer(engine, mail, Reliability(engine=engine), hooks=CrashAfter(crash_at)).deliver(job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
