"""A streaming client for any OpenAI-compatible chat endpoint (`POST {url}/chat/completions` with `stream: true`), for
the demo's LLM chat: OpenAI's own SDK reads the server-sent events, so that their framing, `[DONE]` and error events
are handled by a client that is kept up with the API."""
from __future__ import annotations

import importlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from openai import AsyncOpenAI, DefaultAsyncHttpxClient, Omit, OpenAIError, Timeout
from openai.types.chat import ChatCompletionChunk

# the HTTP client package the SDK is built on (httpx, or its fork httpx2 in openai 3.x), the package of the client
# class the SDK's default client derives from: a response's body must be its AsyncByteStream
_http = importlib.import_module(DefaultAsyncHttpxClient.__mro__[1].__module__.partition(".")[0])

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0  # between two events of the stream
COMPLETIONS_PATH = "/chat/completions"
NO_KEY = "none"  # the SDK insists on a key; without one configured, each request omits its Authorization header
# What one reply may send: a line of its event stream, and all of it (a context takes at most 20,000 characters by
# default; a piece a chunk with its JSON around it is ~200 bytes). A 200 MB event held the gateway's loop for 3 s and
# kept 430 MB; 200,000 empty chunks held it for 9 s (a hostile try, with a misbehaving LLM)
MAX_EVENT_BYTES = 1 << 20
MAX_REPLY_BYTES = 16 << 20


class LLMError(Exception):
    """The LLM could not be reached or answered with an error; the message says which."""


@dataclass(frozen=True)
class LLMConfig:
    url: str  # the API base (`http://localhost:11434/v1`) or the full `.../chat/completions` address
    model: str
    api_key: str | None = None
    system_prompt: str | None = None

    @property
    def base_url(self) -> str:
        """The API base the SDK appends `/chat/completions` to."""
        url = self.url.rstrip("/")
        return url.removesuffix(COMPLETIONS_PATH)


def new_llm_client(config: LLMConfig) -> AsyncOpenAI:
    """One connection pool for a chat socket's turns. No retries: a turn that failed is reported at once, and the
    user asks again."""
    return AsyncOpenAI(base_url=config.base_url, api_key=config.api_key or NO_KEY, max_retries=0,
                       timeout=Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
                       http_client=DefaultAsyncHttpxClient(headers={"Accept-Encoding": "identity"},
                                                           event_hooks={"response": [bound_body]}))


async def bound_body(response: _http.Response) -> None:
    """Reads the response's body through `_BoundedBody` (a hook, so that the client keeps its own transport, proxies
    and limits). The body must come uncompressed: the bounds count what the SDK will gather."""
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise LLMError(f"the LLM answered with a {encoding[:32]!r}-encoded body although none was accepted")
    response.stream = _BoundedBody(response.stream)


class _BoundedBody(_http.AsyncByteStream):
    """A response body that raises LLMError as soon as a line passes MAX_EVENT_BYTES or the whole MAX_REPLY_BYTES,
    before the SDK gathers it."""

    def __init__(self, stream: _http.AsyncByteStream) -> None:
        self.stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        line = total = 0  # bytes of the line not yet ended, and of the body
        async for data in self.stream:
            total += len(data)
            lines = data.split(b"\n")
            line += len(lines[0])
            if len(lines) > 1:
                line = max([line, *map(len, lines[1:-1])])  # the lines this piece holds whole
            if line > MAX_EVENT_BYTES:
                raise LLMError(f"the LLM sent an event of more than {MAX_EVENT_BYTES} bytes")
            if total > MAX_REPLY_BYTES:
                raise LLMError(f"the LLM's reply passed {MAX_REPLY_BYTES} bytes")
            if len(lines) > 1:
                line = len(lines[-1])
            yield data

    async def aclose(self) -> None:
        await self.stream.aclose()


async def stream_chat(client: AsyncOpenAI, config: LLMConfig, messages: list[dict[str, str]]) -> AsyncIterator[str]:
    """The reply's text pieces as the LLM writes them; closing this generator closes the LLM's stream."""
    system = [{"role": "system", "content": config.system_prompt}] if config.system_prompt else []
    no_key = {} if config.api_key else {"Authorization": Omit()}  # a local LLM needs none: send none
    try:
        stream = await client.chat.completions.create(model=config.model, messages=system + messages, stream=True,
                                                      extra_headers=no_key)
        held = ""  # the first half of a surrogate pair whose second half is in the next event
        chunks = 0
        async with stream:
            async for chunk in stream:
                chunks += 1
                piece = _text(chunk)
                if piece:
                    piece, held = _whole_characters(held + piece)
                    if piece:
                        yield piece
        if held:  # the reply ended inside a character
            yield "\ufffd"
        if not chunks:  # a 200 that was no event stream (a web page, a proxy's answer): not an empty reply
            raise LLMError(f"the LLM at {config.base_url} answered with no chat completion events: is it an "
                           "OpenAI-compatible API?")
    except OpenAIError as failure:
        raise LLMError(f"the LLM at {config.base_url} failed: {type(failure).__name__}: {failure}") from None
    except ValueError as failure:  # an event that is not JSON
        raise LLMError(f"the LLM at {config.base_url} sent an event that is not JSON: {failure}") from None


def _text(chunk: ChatCompletionChunk) -> str | None:
    """The text of one chunk (None for a chunk without choices: usage, keep-alive)."""
    try:
        content = chunk.choices[0].delta.content if chunk.choices else None
    except (AttributeError, TypeError, IndexError):  # the SDK builds chunks leniently: a foreign shape gets here
        raise LLMError(f"the LLM sent an event that is not a chat completion chunk: {str(chunk)[:120]}") from None
    if content is not None and not isinstance(content, str):
        raise LLMError(f"the LLM sent content that is not text: {str(content)[:120]}")
    return content


def _whole_characters(text: str) -> tuple[str, str]:
    """(the text in whole characters, a high surrogate held for the next piece). An LLM whose JSON escapes split a
    character outside the BMP (an emoji) across two events sends its surrogate halves apart: they are joined here;
    a surrogate that has no other half becomes U+FFFD, so that one broken character does not end the turn."""
    held = ""
    if text and "\ud800" <= text[-1] <= "\udbff":
        text, held = text[:-1], text[-1]
    return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace"), held
