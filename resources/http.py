"""Plain HTTP services: the artifact store documents to review are fetched from."""

from __future__ import annotations

import httpx
from dagster import ConfigurableResource


class ArtifactStoreResource(ConfigurableResource):
    """GET an artifact by path; a non-2xx answer raises `httpx.HTTPStatusError` for the classifier."""

    base_url: str
    timeout_seconds: float = 10.0

    def fetch(self, path: str) -> bytes:
        response = httpx.get(f"{self.base_url.rstrip('/')}/{path.lstrip('/')}", timeout=self.timeout_seconds)
        response.raise_for_status()
        return response.content
