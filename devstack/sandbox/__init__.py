"""The sandbox: fake providers with recorded side effects and scripted faults (see `app`)."""

from __future__ import annotations

from devstack.sandbox.app import create_app
from devstack.sandbox.client import SandboxAdminError, SandboxClient
from devstack.sandbox.launcher import SandboxProcess

__all__ = ["SandboxAdminError", "SandboxClient", "SandboxProcess", "create_app"]
