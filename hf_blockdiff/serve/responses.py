"""The bodies the server answers with, in OpenAI's shapes (docs/architecture.md, "Server"): a choice's state as its
rows' updates arrive, and the two endpoints' formats of a whole response and of a stream chunk. Both endpoints share
one path; a `Format` says only how its objects look."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from itertools import accumulate

from .bridge import RequestRows, RequestTimeout
from .detokenize import ChoiceText
from .errors import APIError


@dataclass
class ChoiceState:
    """One choice (one engine row): its committed tokens, their log-probabilities, text and finish reason."""

    text: ChoiceText
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    forwards: int = 0
    finish_reason: str | None = None  # the engine's: "stop" (a stop token or string) or "length"

    def apply(self, update) -> str:
        """Take one RowUpdate; the text it adds."""
        self.tokens += update.tokens
        self.logprobs += update.logprobs
        self.forwards = update.forwards
        self.finish_reason = update.finish_reason
        return self.text.push(update.tokens, final=update.finish_reason is not None)


def usage(prompt_tokens: int, choices: list[ChoiceState]) -> dict:
    """OpenAI's usage, and the rows' decoding steps (extension: `forwards`)."""
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "forwards": sum(c.forwards for c in choices)}


class Format:
    """How one endpoint writes its objects; `tokenizer` names the tokens of logprobs."""

    object: str
    chunk_object: str
    id_prefix: str

    def __init__(self, tokenizer, model_name: str, logprobs: bool):
        self.tokenizer, self.model_name, self.logprobs = tokenizer, model_name, logprobs
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_name, "choices": choices}

    def response(self, choices: list[ChoiceState], prompt_tokens: int) -> dict:
        body = self._envelope(self.object, [self.choice(i, c) for i, c in enumerate(choices)])
        return {**body, "usage": usage(prompt_tokens, choices)}

    def chunk(self, index: int, state: ChoiceState, piece: str, update) -> dict:
        """The stream chunk of one update of choice `index` (`state` has taken it): the text it added (and its
        tokens' logprobs), the finish reason on the last one, the row's provisional tokens where drafts were asked
        for (extension: `draft`, the mask id where undecided)."""
        start = len(state.text.text) - len(piece)
        logprobs = self.logprob_object(update.tokens, update.logprobs, start) if self.logprobs else None
        choice = {"index": index, **self.delta(piece), "finish_reason": state.finish_reason, "logprobs": logprobs}
        drafted = choice if update.draft is None else {**choice, "draft": update.draft}
        return self._envelope(self.chunk_object, [drafted])

    def usage_chunk(self, choices: list[ChoiceState], prompt_tokens: int) -> dict:
        """The last chunk with stream_options.include_usage: no choices, the usage."""
        return {**self._envelope(self.chunk_object, []), "usage": usage(prompt_tokens, choices)}

    def first_chunk(self, index: int) -> dict | None:
        return None

    def token_texts(self, tokens: list[int]) -> list[str]:
        return [self.tokenizer.decode([token]) for token in tokens]

    def choice(self, index: int, state: ChoiceState) -> dict:
        raise NotImplementedError

    def delta(self, piece: str) -> dict:
        raise NotImplementedError

    def logprob_object(self, tokens: list[int], logprobs: list[float], start: int = 0) -> dict:
        """The logprobs of `tokens`, whose text begins at character `start` of the choice's text."""
        raise NotImplementedError


class CompletionFormat(Format):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"

    def choice(self, index: int, state: ChoiceState) -> dict:
        return {"index": index, "text": state.text.text, "finish_reason": state.finish_reason,
                "logprobs": self.logprob_object(state.tokens, state.logprobs) if self.logprobs else None}

    def delta(self, piece: str) -> dict:
        return {"text": piece}

    def logprob_object(self, tokens: list[int], logprobs: list[float], start: int = 0) -> dict:
        texts = self.token_texts(tokens)
        offsets = list(accumulate((len(t) for t in texts[:-1]), initial=start))[:len(texts)]
        return {"tokens": texts, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


class ChatFormat(Format):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def choice(self, index: int, state: ChoiceState) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": state.text.text},
                "finish_reason": state.finish_reason,
                "logprobs": self.logprob_object(state.tokens, state.logprobs) if self.logprobs else None}

    def delta(self, piece: str) -> dict:
        return {"delta": {"content": piece} if piece else {}}

    def first_chunk(self, index: int) -> dict:
        """OpenAI's first chunk of a chat choice: the role."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                  "logprobs": None}
        return self._envelope(self.chunk_object, [choice])

    def logprob_object(self, tokens: list[int], logprobs: list[float], start: int = 0) -> dict:
        return {"content": [{"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
                            for text, logprob in zip(self.token_texts(tokens), logprobs)]}


def settled(update) -> None:
    """An APIError for a row the engine did not finish: cancelled (the server is stopping) or failed."""
    if update.finish_reason == "cancelled":
        raise APIError(503, "the server is shutting down: this request's rows were cancelled", code="cancelled")
    if update.finish_reason == "error":
        raise APIError(500, f"the engine failed on this request: {update.error!r}", code="engine_error")


async def choice_updates(rows: RequestRows, choices: list[ChoiceState],
                         timeout: float | None) -> AsyncIterator[tuple[int, str, object]]:
    """(choice index, text added, RowUpdate) as the rows' updates arrive, each applied to its choice; a row the
    engine did not finish, or the request's deadline, raises the APIError the client gets."""
    try:
        async for index, update in rows.updates():
            settled(update)
            yield index, choices[index].apply(update), update
    except RequestTimeout:
        raise APIError(504, f"the request did not finish within the server's --request-timeout of {timeout} s: its "
                       "rows were cancelled", code="timeout") from None
