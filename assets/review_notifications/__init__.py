"""Review notifications: per-recipient outbox, send-then-mark, reconciliation and versioned reruns (002 §6, §8, §10)."""
