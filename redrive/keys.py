"""Keys from configuration: the redaction HMAC key and the key that encrypts secrets at rest.

Production sets ``REDRIVE_REDACTION_KEY`` and ``REDRIVE_SECRETS_KEY``. Unset, each is generated
once per install under ``REDRIVE_DATA_DIR/keys/`` (mode 0600) and shared by every local process,
so the code location, its runs and the commands agree on markers and can read what the others
encrypted. Read when first needed, never at import time.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from cryptography.fernet import Fernet, MultiFernet

from redrive.settings import Settings

__all__ = ["install_key", "redaction_key", "secrets_cipher"]


def install_key(path: Path, make: bytes) -> bytes:
    """The key stored at ``path``, writing ``make`` there first if none is; safe under concurrent starts.

    Written to a temporary file and hard-linked into place: the link fails if another process won,
    and then its key is read, so two processes never end up with different keys.
    """
    if path.exists():
        return path.read_bytes().strip()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, make + b"\n")
    finally:
        os.close(fd)
    try:
        os.link(partial, path)
    except FileExistsError:
        pass
    finally:
        partial.unlink(missing_ok=True)
    return path.read_bytes().strip()


def redaction_key(settings: Settings | None = None) -> bytes:
    """The HMAC key for redaction markers (002 §8.4): REDRIVE_REDACTION_KEY, else the install's own."""
    settings = settings or Settings()
    if settings.redrive_redaction_key:
        return settings.redrive_redaction_key.get_secret_value().encode()
    return install_key(settings.redrive_data_dir / "keys" / "redaction.key", secrets.token_hex(32).encode())


def secrets_cipher(settings: Settings | None = None) -> MultiFernet:
    """Fernet for secrets stored in our tables: REDRIVE_SECRETS_KEY (comma-separated, newest first, for
    rotation), else the install's own generated key."""
    settings = settings or Settings()
    if settings.redrive_secrets_key:
        keys = [k.strip() for k in settings.redrive_secrets_key.get_secret_value().split(",") if k.strip()]
    else:
        keys = [install_key(settings.redrive_data_dir / "keys" / "secrets.key", Fernet.generate_key()).decode()]
    return MultiFernet([Fernet(k) for k in keys])
