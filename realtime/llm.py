"""A streaming client for any OpenAI-compatible chat endpoint (`POST {url}/chat/completions` with `stream: true`,
answered by server-sent events), for the demo's LLM chat."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0  # between two events of the stream


class LLMError(Exception):
    """The LLM could not be reached or answered with an error; the message says which."""


@dataclass(frozen=True)
class LLMConfig:
    url: str  # the API base (`http://localhost:11434/v1`) or the full `.../chat/completions` address
    model: str
    api_key: str | None = None
    system_prompt: str | None = None

    @property
    def endpoint(self) -> str:
        url = self.url.rstrip("/")
        return url if url.endswith("/chat/completions") else url + "/chat/completions"


def new_http_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S))


async def stream_chat(client: httpx.AsyncClient, config: LLMConfig,
                      messages: list[dict[str, str]]) -> AsyncIterator[str]:
    """The reply's text pieces as the LLM writes them."""
    body = {"model": config.model, "stream": True,
            "messages": ([{"role": "system", "content": config.system_prompt}] if config.system_prompt else [])
            + messages}
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    try:
        async with client.stream("POST", config.endpoint, json=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode("utf-8", "replace")[:200]
                raise LLMError(f"the LLM answered HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                piece = _delta(line)
                if piece is _DONE:
                    return
                if piece:
                    yield piece
    except (httpx.HTTPError, httpx.InvalidURL) as failure:
        raise LLMError(f"the LLM at {config.endpoint} failed: {type(failure).__name__}: {failure}") from None


_DONE = object()


def _delta(line: str) -> str | object | None:
    """The text of one server-sent event line (None for other lines), or _DONE at the end of the stream."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return _DONE
    try:
        chunk: Any = json.loads(data)
        if "error" in chunk:
            raise LLMError(f"the LLM reported an error: {str(chunk['error'])[:200]}")
        return (chunk["choices"][0].get("delta") or {}).get("content") if chunk.get("choices") else None
    except (json.JSONDecodeError, KeyError, IndexError, TypeError, AttributeError):
        raise LLMError(f"the LLM sent an event that is not a chat completion chunk: {data[:120]!r}") from None
