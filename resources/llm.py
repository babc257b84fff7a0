"""An OpenAI-compatible chat-completions client that returns a validated decision or raises.

No path returns an empty result on failure (000's silent degradation): an HTTP error
raises `httpx.HTTPStatusError`, a body that is not JSON raises `json.JSONDecodeError`,
and a reply that does not fit the schema raises `pydantic.ValidationError`; the
core's classifier names each of them.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import httpx
from dagster import ConfigurableResource
from pydantic import BaseModel

from redrive.upstreams import aguarded, guarded
from resources.http import shared_async_client, shared_client

M = TypeVar("M", bound=BaseModel)


class LlmResource(ConfigurableResource):
    base_url: str
    api_key: str
    model: str = "gpt-4o-mini"
    timeout_seconds: float = 30.0

    def chat_json(self, messages: list[dict[str, str]], schema: type[M], *, client: httpx.Client | None = None) -> M:
        http = client or shared_client()
        url, body, headers = self._request(messages)
        response = guarded("llm", lambda: http.post(url, json=body, headers=headers, timeout=self.timeout_seconds))
        return _decision(response, schema)

    async def achat_json(self, messages: list[dict[str, str]], schema: type[M]) -> M:
        """`chat_json` awaited: the seconds an LLM takes hold no thread."""
        http = shared_async_client()
        url, body, headers = self._request(messages)
        response = await aguarded("llm", lambda: http.post(url, json=body, headers=headers,
                                                           timeout=self.timeout_seconds))
        return _decision(response, schema)

    def _request(self, messages: list[dict[str, str]]) -> tuple[str, dict[str, Any], dict[str, str]]:
        body = {"model": self.model, "messages": messages, "response_format": {"type": "json_object"}}
        return (f"{self.base_url.rstrip('/')}/chat/completions", body, {"Authorization": f"Bearer {self.api_key}"})


def _decision(response: httpx.Response, schema: type[M]) -> M:
    """The completion's JSON content, validated; an HTTP error, a bad envelope or a bad reply raises."""
    try:
        response.raise_for_status()
        envelope: dict[str, Any] = json.loads(response.content)
        content = envelope["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError) as exc:
        raise json.JSONDecodeError(f"unexpected completion envelope: {type(exc).__name__}", "", 0) from exc
    return schema.model_validate(json.loads(content))
