"""From a validated request to the engine's rows, or a 400 naming the field (docs/architecture.md, "Server"): the model
name, the prompt's tokens, the output length (the server's most, its default), the seeds of the n rows. What the
engine's `submit` refuses (a prompt outside the vocabulary or longer than the server takes, a threshold the strategy
does not take) is a 400 naming the request field the engine's message names; nothing is queued then."""

from __future__ import annotations

from dataclasses import dataclass

from ..generation.live import RowSettings, random_seed, row_seeds
from ..integrations.completions import encode
from .errors import APIError
from .schemas import ChatCompletionRequest, CompletionRequest, Sampling


@dataclass(frozen=True)
class Limits:
    """What the server's LiveEngine holds: its longest prompt and most new tokens (together within the model's
    positions)."""

    max_prompt_tokens: int
    max_new_tokens: int


@dataclass(frozen=True)
class Admitted:
    """A request the server takes: its prompt's tokens and one RowSettings per choice."""

    prompt: list[int]
    rows: list[RowSettings]


def completion_prompt(request: CompletionRequest, tokenizer) -> list[int]:
    return list(request.prompt) if isinstance(request.prompt, list) else encode(request.prompt, tokenizer)


def chat_prompt(request: ChatCompletionRequest, tokenizer) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(400, "messages: the model's tokenizer has no chat template; use /v1/completions with a "
                       "prompt", "messages")
    return encode([m.model_dump(exclude_none=True) for m in request.messages], tokenizer, chat=True)


def admit(request: Sampling, prompt: list[int], model_name: str, limits: Limits) -> Admitted:
    """The rows of `request` (ids of `prompt` already encoded), or an APIError naming the field."""
    if request.model != model_name:
        raise APIError(400, f"model: {request.model!r} is not served here; this server serves {model_name!r}",
                       "model", "model_not_found")
    new_tokens = output_length(request, limits)
    if request.blockdiff.drafts and not request.stream:
        raise APIError(400, "blockdiff.drafts: drafts come in stream chunks; set stream: true", "blockdiff.drafts")
    seed = random_seed() if request.seed is None else request.seed
    rows = [RowSettings(max_new_tokens=new_tokens, seed=row_seed, temperature=request.temperature,
                        top_p=request.top_p, top_k=request.top_k, threshold=request.blockdiff.threshold,
                        stop_strings=request.stop_strings, drafts=request.blockdiff.drafts)
            for row_seed in row_seeds(seed, request.n)]
    return Admitted(prompt, rows)


def output_length(request: Sampling, limits: Limits) -> int:
    """max_tokens (chat: max_completion_tokens), else the server's most."""
    field = request.new_tokens_field
    if request.new_tokens is not None and request.new_tokens > limits.max_new_tokens:
        raise APIError(400, f"{field}={request.new_tokens}: this server generates at most {limits.max_new_tokens} "
                       "tokens per row (the model's positions hold its longest prompt and those)", field)
    return limits.max_new_tokens if request.new_tokens is None else request.new_tokens


# the RowSettings field an engine error names -> the request field a 400 names
ENGINE_FIELDS = {"max_new_tokens": None, "threshold": "blockdiff.threshold", "drafts": "blockdiff.drafts",
                 "stop_strings": "stop", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "seed": "seed", "prompt": None}


def engine_refusal(error: ValueError, request: Sampling) -> APIError:
    """A 400 for what the engine refused on submit, naming the request field its message names first."""
    message = str(error)
    named = [(message.find(name), name) for name in ENGINE_FIELDS if name in message]
    name = min(named)[1] if named else None
    fallback = {"max_new_tokens": request.new_tokens_field,
                "prompt": "messages" if isinstance(request, ChatCompletionRequest) else "prompt"}
    return APIError(400, message, ENGINE_FIELDS.get(name) or fallback.get(name))
