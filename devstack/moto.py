"""A moto server on a loopback port, serving S3 and SQS as AWS would over HTTP.

`python -m devstack.moto -H HOST -p PORT` is moto's own server with one fix: moto 5.2's ReceiveMessage
checks each message it hands out against the queue's retention period by building *all* the queue's
attributes three times (each an O(queue length) scan of every message's visibility and delay), so one
receive of 10 from a backlog of 300 costs ~27,000 clock reads (0.3–0.8 s on this machine). AWS pays
nothing of the kind; the fix reads the one attribute it needs, with the same result. And moto hands
the same message to two receives that run at once (its receive holds no lock; the drain receives from
several threads): receives of one queue are serialized here, as SQS effectively does for a message.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

from devstack.process import Child, spawn

MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def start_moto(log_dir: Path | None = None) -> Child:
    return spawn("moto", ["-m", "devstack.moto", "-H", "127.0.0.1", "-p", "{port}"], "/moto-api/", log_dir=log_dir)


def retention_check_in_constant_time() -> None:
    """moto's `is_message_valid_based_on_retention_period`, reading `MessageRetentionPeriod` alone."""
    from moto.core.utils import unix_time
    from moto.sqs.models import Message, SQSBackend

    def is_message_valid_based_on_retention_period(self: SQSBackend, queue_name: str, message: Message) -> bool:
        retention_period = int(self.get_queue(queue_name).message_retention_period)
        return retention_period + message.sent_timestamp / 1000 > unix_time()  # type: ignore[operator]

    SQSBackend.is_message_valid_based_on_retention_period = is_message_valid_based_on_retention_period


def receives_serialized_per_queue() -> None:
    """moto's `receive_message` under a lock per queue, so one visible message goes to one receive."""
    from moto.sqs.models import SQSBackend

    receive = SQSBackend.receive_message
    locks: dict[str, threading.Lock] = {}
    guard = threading.Lock()

    def receive_message(self: SQSBackend, queue_name: str, *args: Any, **kwargs: Any) -> Any:
        with guard:
            lock = locks.setdefault(f"{self.account_id}/{self.region_name}/{queue_name}", threading.Lock())
        with lock:
            return receive(self, queue_name, *args, **kwargs)

    SQSBackend.receive_message = receive_message  # type: ignore[method-assign]


if __name__ == "__main__":
    from moto.server import main

    retention_check_in_constant_time()
    receives_serialized_per_queue()
    main(sys.argv[1:])
