"""Server-sent events in OpenAI's stream format (docs/architecture.md, "Server"): each chunk a `data: <json>` event,
then `data: [DONE]`. An error after the stream began (a timeout, the server stopping) is one event holding OpenAI's
error object, which the `openai` client raises as an APIError, then `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from .bridge import RequestRows
from .errors import APIError
from .responses import ChoiceState, Format, choice_updates

DONE = b"data: [DONE]\n\n"
MEDIA_TYPE = "text/event-stream"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # proxies pass each event on at once


def event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def stream_events(rows: RequestRows, fmt: Format, choices: list[ChoiceState], prompt_tokens: int,
                        include_usage: bool, timeout: float | None) -> AsyncIterator[bytes]:
    """The events of one streamed request: a chunk per update that adds text, logprobs, a draft or the finish
    reason, in the order the engine committed them. A client that disconnects cancels this generator (Starlette's
    StreamingResponse), and leaving `with rows` cancels the rows, before an error event goes out."""
    refused = None
    with rows:
        try:
            for index in range(len(choices)):
                if (first := fmt.first_chunk(index)) is not None:
                    yield event(first)
            async for index, piece, update in choice_updates(rows, choices, timeout):
                if piece or update.tokens or update.finish_reason is not None or update.draft is not None:
                    yield event(fmt.chunk(index, choices[index], piece, update))
            if include_usage:
                yield event(fmt.usage_chunk(choices, prompt_tokens))
        except APIError as error:
            refused = error
    if refused is not None:
        yield event(refused.body())
    yield DONE
