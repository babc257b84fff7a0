"""Matchmaking (ADR-0004): daily match offers per (date, timezone), idempotent per user and deterministic."""
