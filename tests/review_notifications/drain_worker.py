"""A drain process killed with SIGKILL mid-drain, right after the provider accepted its N-th send.

    python -m tests.review_notifications.drain_worker DATABASE_URL START_ISO KILL_AT

Runs the core's `Drain` with this pipeline's handler, 4 jobs in flight, on a clock frozen at START
(the test's past, so the leases it takes have run out when the next drain looks), and kills itself
from the send-and-mark seam: no `finally`, no rollback, no lease given back, the other threads
stopped wherever they were. Exits 0 only if it was never killed (the test then fails).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from datetime import datetime

from assets.review_notifications import pipeline, policy
from redrive.clock import FrozenClock
from redrive.db import engine_for
from redrive.drain import Drain
from redrive.reliability import Reliability
from resources.review_notifications import MailProvider


class KillAfter:
    def __init__(self, n: int) -> None:
        self.left, self.lock = n, threading.Lock()

    def after_provider_accept(self, delivery_id: int, message_id: str) -> None:
        with self.lock:
            self.left -= 1
            if self.left == 0:
                os.kill(os.getpid(), signal.SIGKILL)


def main(url: str, start: str, kill_at: int) -> int:
    engine = engine_for(url)
    runtime = Reliability(engine=engine, clock=FrozenClock(datetime.fromisoformat(start)))
    with MailProvider(f"{os.environ['SANDBOX_URL']}/mail/v1", "sandbox-token") as mail:
        handler = pipeline.ReviewJobHandler(runtime, mail, hooks=KillAfter(kill_at))
        Drain(reliability=runtime, pipeline=policy.PIPELINE, policies=pipeline.stage_policies(), owner="doomed",
              concurrency=4, linger_seconds=0.0).run(handler)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
