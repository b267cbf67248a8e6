"""`hf-blockdiff serve` decodes one row before it listens (docs/architecture.md, "Server"): that row's forwards compile
the decoder layers and the step's bookkeeping and capture the step's graphs, tens of seconds on a GPU that the first
clients would otherwise wait for. Then the heap is frozen out of the garbage collector's reach (`gc.freeze`): the
compiled code leaves about 700k tracked objects, and a full collection over them paused the whole server 0.4-0.5 s,
once in about 25 rounds of 128 streamed requests (docs/benchmarks.md, "Serving under load"). Freezing acts on the
whole process, so it is the command's choice (`Server.warm_up`), not the engine's."""

from __future__ import annotations

import gc
import logging
import threading
import time

from ..generation.live import RowSettings
from .admission import Limits

LOG = logging.getLogger("uvicorn.error")
PROMPT_TOKENS = 64  # the warm-up row's prompt (fewer where the server takes shorter ones): any width compiles alike
TIMEOUT_S = 1800.0  # a warm-up past this is left running and the server listens (the first clients then wait)


def warm_up(engine, limits: Limits, timeout: float = TIMEOUT_S) -> None:
    """Decode one row of `limits.max_new_tokens` after a prompt of token 0s on the started `engine`, then freeze the
    heap. RuntimeError if the row ends with an error (the server would fail every request alike)."""
    ended, outcome = threading.Event(), {}

    def on_update(update) -> None:
        if update.finish_reason is not None:
            outcome.update(reason=update.finish_reason, error=update.error)
            ended.set()

    began = time.perf_counter()
    prompt = [0] * min(PROMPT_TOKENS, limits.max_prompt_tokens)
    handle = engine.submit(prompt, RowSettings(max_new_tokens=limits.max_new_tokens, seed=0), on_update)
    if not ended.wait(timeout):
        handle.cancel()
        LOG.warning(f"hf-blockdiff serve: the warm-up row did not finish within {timeout:.0f} s; it is cancelled and "
                    "the server listens (the first requests compile what is left)")
        return
    if outcome["reason"] == "error":
        raise RuntimeError(f"hf-blockdiff serve: the warm-up row failed, so every request would: {outcome['error']!r}")
    gc.collect()
    gc.freeze()
    LOG.info(f"hf-blockdiff serve: warmed up in {time.perf_counter() - began:.1f} s; {gc.get_freeze_count()} objects "
             "frozen out of the garbage collector's reach")
