"""Operators of the dead-letter console and their tokens (issue 27 §2): not the conversion owners' tokens.

Only a token's SHA-256 is stored; `redrive console token NAME` shows the token once. Every action the console
takes is recorded in the letter's notes under `operator:<name>`.
"""

from __future__ import annotations

import hashlib
import secrets

import sqlalchemy as sa

from redrive.schema import NOW, TZ, metadata

operator_tokens = sa.Table(
    "operator_tokens",
    metadata,
    sa.Column("token_sha256", sa.Text, primary_key=True),
    sa.Column("operator", sa.Text, nullable=False),
    sa.Column("created_at", TZ, nullable=False, server_default=NOW),
    sa.Column("revoked_at", TZ),
)


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def create_token(conn: sa.Connection, operator: str) -> str:
    """A new token for `operator` (shown this once)."""
    token = f"rdo_{secrets.token_urlsafe(24)}"
    conn.execute(sa.insert(operator_tokens).values(token_sha256=_hash(token), operator=operator))
    return token


def operator_for(conn: sa.Connection, token: str) -> str | None:
    """The operator a live token belongs to, or None."""
    return conn.execute(sa.select(operator_tokens.c.operator).where(
        operator_tokens.c.token_sha256 == _hash(token), operator_tokens.c.revoked_at.is_(None))).scalar()
