"""The request bodies of `/v1/completions` and `/v1/chat/completions` as pydantic models (docs/architecture.md,
"Server"): strict types (a string where a number belongs is refused, not converted), OpenAI's ranges, unknown fields
refused by name, and the extension object `blockdiff`. What needs the model or the tokenizer (the model name, prompt
lengths, token ids in the vocabulary) is checked on admission (`admission.py`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_SEED = 2**63  # seeds are 0 <= seed < 2**63, as torch.Generator.manual_seed takes them


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class BlockdiffOptions(Strict):
    """The extension object: the strategy's threshold for this request's rows, and provisional tokens in the stream."""

    threshold: float | None = None
    drafts: bool = False


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """Fields both endpoints take. None takes the server's value (its config, flags or preset)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None  # extension: 0 or less is off
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, ignored
    blockdiff: BlockdiffOptions = BlockdiffOptions()

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, stop):
        if stop is not None and ("" in ([stop] if isinstance(stop, str) else stop)):
            raise ValueError("stop strings must not be empty")
        return stop

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def new_tokens(self) -> int | None:
        """The requested output length (chat: max_completion_tokens before max_tokens)."""
        return self.max_tokens

    @property
    def new_tokens_field(self) -> str:
        return "max_tokens"

    @property
    def wants_logprobs(self) -> bool:
        raise NotImplementedError


class CompletionRequest(Sampling):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = None  # only 0: the committed tokens' own log-probabilities, no alternatives

    @field_validator("logprobs")
    @classmethod
    def _only_own_logprobs(cls, logprobs):
        if logprobs not in (None, 0):
            raise ValueError("only logprobs=0 is supported (the committed tokens' log-probabilities; no alternatives "
                             "are kept)")
        return logprobs

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str
    name: str | None = None


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None  # only 0

    @field_validator("top_logprobs")
    @classmethod
    def _no_alternatives(cls, top_logprobs):
        if top_logprobs not in (None, 0):
            raise ValueError("only top_logprobs=0 is supported (no alternatives to the committed tokens are kept)")
        return top_logprobs

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def new_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs


# every field name of the request models: an error's location is cut at the first part that is none of them
# (pydantic names the member of a union it tried, "str" or "list[int]", after the field)
FIELD_NAMES = frozenset(name for cls in (CompletionRequest, ChatCompletionRequest, ChatMessage, BlockdiffOptions,
                                         StreamOptions) for name in cls.model_fields)
