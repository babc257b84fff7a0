"""devstack's moto: the constant-time retention check answers as moto's own does."""

from __future__ import annotations

import pytest
from moto.core.utils import unix_time_millis
from moto.sqs.models import Message, SQSBackend

from devstack.moto import retention_check_in_constant_time


@pytest.mark.parametrize("age_seconds", [0, 59, 61, 3600])
def test_retention_check_agrees_with_moto(monkeypatch, age_seconds: int) -> None:
    """A message younger than the queue's 60 s retention is valid, an older one is not — before and after."""
    original = SQSBackend.is_message_valid_based_on_retention_period
    monkeypatch.setattr(SQSBackend, "is_message_valid_based_on_retention_period", original)  # restored after
    backend = SQSBackend("us-east-1", "123456789012")
    backend.create_queue("q", MessageRetentionPeriod="60")
    message = Message("m-1", "{}")
    message.sent_timestamp = int(unix_time_millis()) - age_seconds * 1000
    before = backend.is_message_valid_based_on_retention_period("q", message)
    retention_check_in_constant_time()
    after = backend.is_message_valid_based_on_retention_period("q", message)
    assert before == after == (age_seconds < 60)
