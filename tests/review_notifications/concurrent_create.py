"""One process of the "50 concurrent creations" test: N threads submit the same request at once.

    python -m tests.review_notifications.concurrent_create DATABASE_URL THREADS < go

Prints "ready" once every thread holds a warm connection and waits; on a line on stdin all
threads call `api.submit` together; then prints one JSON line: [[job_id, mode, created], …].
"""

from __future__ import annotations

import json
import sys
import threading

from assets.review_notifications import api
from redrive.db import engine_for

REQUEST = {"idempotency_key": "same-key", "changelist_id": "CL-race", "review_version": 3,
           "recipients": ["ana@example.com", "bo@example.com"], "summary": "race"}


def main(url: str, threads: int) -> None:
    engine = engine_for(url)
    go = threading.Event()
    ready = threading.Barrier(threads + 1)
    results: list[list[object]] = []
    lock = threading.Lock()

    def worker() -> None:
        with engine.connect() as conn:  # a warm pool connection per thread, so the start is simultaneous
            conn.exec_driver_sql("SELECT 1")
        ready.wait()
        go.wait()
        submission = api.submit(engine, REQUEST)
        with lock:
            results.append([submission.job.id, str(submission.mode), submission.created])

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    ready.wait()
    print("ready", flush=True)
    sys.stdin.readline()
    go.set()
    for t in pool:
        t.join()
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
