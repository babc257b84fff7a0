"""A moto server on a loopback port, serving S3 and SQS as AWS would over HTTP."""

from __future__ import annotations

from pathlib import Path

from devstack.process import Child, spawn

MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def start_moto(log_dir: Path | None = None) -> Child:
    return spawn("moto", ["-m", "moto.server", "-H", "127.0.0.1", "-p", "{port}"], "/moto-api/", log_dir=log_dir)
