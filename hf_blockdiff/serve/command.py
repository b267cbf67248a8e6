"""`hf-blockdiff serve`: load the model, build its LiveEngine and serve the app with uvicorn until SIGTERM or Ctrl+C
(docs/architecture.md, "Server"). Importing this module needs the `serve` extra: the CLI defines the command's flags
and imports it only to run."""

from __future__ import annotations

from dataclasses import dataclass

import uvicorn

from ..config import BlockDiffusionConfig
from ..config.checks import decoded_block_size
from ..config.profiles import model_profile
from ..generation.live import LiveEngine
from ..integrations.checkpoint import load_pretrained
from .admission import Limits
from .app import Server, create_app


@dataclass(frozen=True)
class ServeOptions:
    """The command's flags beside the model and its decoding config."""

    model: str  # the --model value as given: the name clients send
    path: str  # its checkpoint directory
    host: str
    port: int
    max_batch_size: int
    max_queue: int
    api_key: str | None
    request_timeout: float
    tensor_parallel_size: int
    device: str | None
    dtype: str
    max_new_tokens_given: bool


def check_options(options: ServeOptions) -> None:
    for name, value in (("--max-batch-size", options.max_batch_size), ("--max-queue", options.max_queue),
                        ("--port", options.port)):
        if value < 1:
            raise ValueError(f"{name} {value}: give at least 1")
    if options.request_timeout <= 0:
        raise ValueError(f"--request-timeout {options.request_timeout}: give a positive number of seconds")
    if options.tensor_parallel_size != 1:
        raise ValueError("--tensor-parallel-size: the live engine decodes in one process; serve a model that fits "
                         "one device (--tensor-parallel-size 1)")


def limits_of(model, config: BlockDiffusionConfig, max_new_tokens_given: bool) -> Limits:
    """The engine's capacities: max_new_tokens as given, else the config's lowered to the whole blocks of half the
    model's positions; prompts as long as the positions hold before those new tokens' blocks."""
    text_config = model.config.get_text_config()
    positions = getattr(text_config, "max_position_embeddings", None)
    new_tokens = config.max_new_tokens
    if positions is None:
        return Limits(new_tokens, new_tokens)
    block = decoded_block_size(config, model_profile(model)) or 1
    if not max_new_tokens_given:
        new_tokens = min(new_tokens, max(positions // 2 // block * block, 1))
    prompt_tokens = positions // block * block - -(-new_tokens // block) * block  # whole blocks, either alignment
    if prompt_tokens < 1:
        raise ValueError(f"--max-new-tokens {new_tokens} leaves no room for a prompt in the model's {positions} "
                         "positions: lower it")
    return Limits(prompt_tokens, new_tokens)


def serve(options: ServeOptions, config: BlockDiffusionConfig) -> None:
    check_options(options)
    model, tokenizer = load_pretrained(options.path, options.device, options.dtype, options.tensor_parallel_size)
    limits = limits_of(model, config, options.max_new_tokens_given)
    engine = LiveEngine(model, config.replace(max_new_tokens=limits.max_new_tokens),
                        max_batch_size=options.max_batch_size, max_prompt_tokens=limits.max_prompt_tokens,
                        max_new_tokens=limits.max_new_tokens, tokenizer=tokenizer)
    server = Server(engine, tokenizer, options.model, limits, options.max_queue, options.request_timeout,
                    options.api_key, warm_up=True)
    # SIGTERM/Ctrl+C: uvicorn stops accepting, lets the requests in flight finish within the request timeout (then
    # cancels them), and the app's shutdown closes the engine
    uvicorn.run(create_app(server), host=options.host, port=options.port, log_level="info",
                timeout_graceful_shutdown=options.request_timeout)

