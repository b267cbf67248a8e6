"""Serving: a live queue of rows decoded by continuous batching, each row by its own settings (docs/architecture.md,
"Serving"). An engine thread admits queued rows into free slots between steps, reports each row's newly committed
tokens after every step and harvests finished and cancelled rows; a row's tokens equal those of offline
`generate_multi_block` of its prompt, settings and seed, whatever else is in the batch (exact on CPU in float32).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import torch
from transformers.utils import logging

from ..config import BlockDiffusionConfig
from .engine import request_seeds, serving_engine
from .lock import model_lock
from .rows import Row, RowLoop, RowOutput, RowProgress
from .serving import ServingLimits, check_prompt, check_settings
from .stop_strings import StopStrings

logger = logging.get_logger(__name__)
IDLE_WAIT_S = 1.0  # an idle engine thread looks again at least this often (a missed notify never stalls it)
# an idle engine's first row waits while more keep coming, each within BURST_GAP_S of the last, BURST_MAX_S in all
BURST_GAP_S, BURST_MAX_S = 0.002, 0.05


@dataclass(frozen=True)
class RowSettings:
    """One row's own settings; None takes the engine config's value."""

    max_new_tokens: int
    seed: int  # the row's noise seed exactly as offline decoding assigns it (see row_seeds)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    threshold: float | None = None  # the engine strategy's threshold (ValueError if the strategy has none)
    stop_strings: tuple[str, ...] = ()  # needs the engine's tokenizer; as transformers' stop_strings
    drafts: bool = False  # also report provisional tokens after each step


def row_seeds(seed: int, n: int) -> list[int]:
    """Noise seeds of the n samples of a request with `seed`: exactly those offline
    model.generate_multi_block(prompt[None], ..., num_return_sequences=n, generator=torch.Generator().manual_seed(seed))
    gives its rows 0..n-1."""
    return request_seeds(n, torch.Generator().manual_seed(seed)).tolist()


def random_seed() -> int:
    """A request seed (for `row_seeds`) for a request without one."""
    return secrets.randbits(31)


@dataclass
class RowUpdate:
    """Delivered to the row's callback from the engine thread."""

    tokens: list[int]  # newly COMMITTED output tokens, in order, following those delivered before
    logprobs: list[float]  # of those tokens
    forwards: int  # decoding steps this row has taken so far
    finish_reason: str | None  # None while running; then "stop" | "length" | "cancelled" | "error" (once per row)
    draft: list[int] | None = None  # with settings.drafts: the row's output so far, mask id where undecided
    error: BaseException | None = None  # with finish_reason "error"


class _LiveRow:
    """A submitted row: the loop's `Row`, its callback and whether its final update went out."""

    def __init__(self, row: Row | None, on_update: Callable[[RowUpdate], None]):
        self.row, self.on_update = row, on_update
        self.forwards, self.finished = 0, False

    def deliver(self, update: RowUpdate) -> None:
        if self.finished:
            return
        self.finished = update.finish_reason is not None
        try:
            self.on_update(update)
        except Exception:  # a caller's callback never stops the engine
            logger.exception("a row's on_update raised; the engine goes on")

    def progress(self, progress: RowProgress) -> None:
        self.forwards = progress.steps
        draft = None if progress.draft is None else progress.draft.tolist()
        self.deliver(RowUpdate(progress.tokens, progress.logprobs, progress.steps, None, draft))

    def finish(self, output: RowOutput) -> None:
        sent, end = self.row.sent, output.length
        self.deliver(RowUpdate(output.tokens[sent:end].tolist(), output.logprobs[sent:end].tolist(), output.steps,
                               "stop" if output.stopped else "length"))

    def end(self, reason: str, error: BaseException | None = None) -> None:
        self.deliver(RowUpdate([], [], self.forwards, reason, error=error))


class RowHandle:
    def __init__(self, engine: "LiveEngine", live: _LiveRow):
        self._engine, self._live = engine, live

    def cancel(self) -> None:
        """Thread-safe: the row leaves at the next step boundary, its slot is freed, its callback gets a final update
        with finish_reason "cancelled"."""
        self._engine._cancel(self._live)


class LiveEngine:
    """Continuous batching of a live queue on `model` (see the module docstring and docs/architecture.md,
    "Serving"). The engine's config (strategy, block size, window mode) is the server's; rows bring their own length,
    sampling, threshold, seed and stop strings (`RowSettings`)."""

    def __init__(self, model, config: BlockDiffusionConfig | None = None, *, max_batch_size: int,
                 max_prompt_tokens: int, max_new_tokens: int, tokenizer=None, **config_keywords):
        """Validates (ValueError naming the argument) and fixes the engine's config and capacity; starts no
        thread."""
        self.model, self.tokenizer = model, tokenizer
        self.limits = ServingLimits.of(model, config, max_batch_size, max_prompt_tokens, max_new_tokens,
                                       config_keywords)
        self.cfg = self.limits.cfg
        self._cond = threading.Condition(threading.RLock())
        self._incoming: list[_LiveRow] = []
        self._cancels: list[_LiveRow] = []
        self._rows: dict[Row, _LiveRow] = {}
        self._thread: threading.Thread | None = None
        self._stopping, self._cancel_on_stop, self._closed = False, True, False
        self._loop: RowLoop | None = None
        self._count, self._forwards = 0, 0

    # -- the callers' side -------------------------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], settings: RowSettings, on_update: Callable[[RowUpdate], None],
               group: Hashable | None = None) -> RowHandle:
        """Thread-safe; bad settings or prompt → ValueError naming the field, raised here, nothing queued. Rows
        submitted with one `group` (the n samples of one request: the same prompt) share the prompt's prefix pages
        while they decode together, as offline samples do."""
        ids = check_prompt(prompt, self.limits)
        slot_settings = check_settings(settings, self.limits)
        if not callable(on_update):
            raise TypeError("on_update must be callable: it receives each RowUpdate of the row.")
        stops = StopStrings(settings.stop_strings, self.tokenizer) if settings.stop_strings else None
        with self._cond:
            if self._stopping or self._closed:
                raise RuntimeError("LiveEngine is closed: submit rows before close().")
            self._count += 1
            live = _LiveRow(None, on_update)
            shares = ("row", self._count) if group is None else ("group", group)
            live.row = Row(ids, settings.seed, slot_settings, shares, self._count, live.finish, live.progress,
                           settings.drafts, stops)
            self._incoming.append(live)
            self._cond.notify_all()
        return RowHandle(self, live)

    def start(self) -> None:
        """Starts the engine thread (once)."""
        with self._cond:
            if self._thread is not None or self._closed:
                raise RuntimeError("LiveEngine.start() runs once, before close().")
            self._thread = threading.Thread(target=self._serve, name="hf-blockdiff-live", daemon=True)
            self._thread.start()

    def close(self, cancel: bool = True, timeout: float | None = None) -> None:
        """Stops the thread: cancel=True cancels queued and running rows (each gets its final update), False lets
        running rows finish first (queued ones are cancelled); the model is left exactly as before start().
        TimeoutError if the thread did not stop within `timeout` seconds (it stops after its step)."""
        with self._cond:
            self._stopping, self._cancel_on_stop = True, cancel
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            self._drop_all()
        else:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"LiveEngine.close: the engine thread did not stop within {timeout} s.")
        self._closed = True

    @property
    def queue_depth(self) -> int:
        loop = self._loop
        return len(self._incoming) + (len(loop.queue) if loop is not None else 0)

    @property
    def running(self) -> int:
        loop = self._loop
        return 0 if loop is None else sum(row is not None for row in loop.running)

    @property
    def slots(self) -> int:
        """Rows decoded at once: max_batch_size, or fewer where the KV-cache budget holds fewer canvases."""
        loop = self._loop
        return self.limits.slots if loop is None else loop.state.num_rows

    @property
    def forwards(self) -> int:
        return self._forwards

    def _cancel(self, live: _LiveRow) -> None:
        with self._cond:
            self._cancels.append(live)
            self._cond.notify_all()

    # -- the engine thread -------------------------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            self._loop = self._build()
            while self._between_steps():
                self._step()
        except BaseException as error:  # building failed: every row fails (the thread never dies silently)
            logger.exception("the live engine stopped")
            self._fail_running(error)
            self._drop_all("error", error)
        finally:
            self._drop_all()
            self._loop = None

    def _build(self) -> RowLoop:
        with model_lock(self.model), self.limits.decoding(self.model):
            return RowLoop(serving_engine(self.model, self.limits))

    def _between_steps(self) -> bool:
        """Take in submitted and cancelled rows; wait while there is nothing to do; False once the engine stops."""
        loop = self._loop
        while True:
            with self._cond:
                if self._incoming and not loop.busy:
                    self._gather_burst(loop.state.num_rows)
                incoming, cancels = self._incoming, self._cancels
                self._incoming, self._cancels = [], []
                stopping = self._stopping
                idle = not incoming and not cancels and not loop.busy and not stopping
                if idle:
                    self._cond.wait(IDLE_WAIT_S)
                    continue
            for live in incoming:
                self._rows[live.row] = live
                loop.submit(live.row)
            for live in cancels:
                if loop.cancel(live.row):
                    self._rows.pop(live.row, None)
                live.end("cancelled")
            if stopping:
                for row in list(loop.queue) + ([r for r in loop.running if r] if self._cancel_on_stop else []):
                    loop.cancel(row)
                    self._rows.pop(row).end("cancelled")
                return loop.busy
            return True

    def _gather_burst(self, slots: int) -> None:
        """Under the lock, the engine idle: clients that start together send a burst, and admitting its first row
        alone costs a prefill and a step before the rest join. Wait while rows keep arriving (each within
        BURST_GAP_S of the last, BURST_MAX_S in all, up to a full batch) so the burst is admitted at once."""
        deadline = time.monotonic() + BURST_MAX_S
        while len(self._incoming) < slots and not self._stopping:
            seen, left = len(self._incoming), deadline - time.monotonic()
            if left <= 0:
                return
            self._cond.wait(min(BURST_GAP_S, left))
            if len(self._incoming) == seen:
                return

    def _step(self) -> None:
        loop = self._loop
        try:
            with model_lock(self.model), self.limits.decoding(self.model):
                loop.advance()
                self._forwards = loop.forwards  # not the scheduler's counter: that read waits for the step ahead
        except Exception as error:
            logger.exception("a live engine step failed: its running rows end with an error")
            self._fail_running(error)
            return
        held = set(loop.queue) | set(loop.running)  # rows hash by identity: one pass, not one list scan per row
        for row in [row for row in self._rows if row not in held]:
            self._rows.pop(row)  # finished: `finish` delivered their final update

    def _fail_running(self, error: BaseException) -> None:
        """The running rows end with `error`; the engine starts afresh (queued rows stay queued)."""
        loop = self._loop
        if loop is None:
            return
        for row in loop.running:
            if row is not None:
                self._rows.pop(row).end("error", error)
        loop.restart()

    def _drop_all(self, reason: str = "cancelled", error: BaseException | None = None) -> None:
        """Rows still waiting or held end with `reason` (the engine stops)."""
        with self._cond:
            rows = list(self._rows.values()) + self._incoming + self._cancels
            self._rows, self._incoming, self._cancels = {}, [], []
        for live in rows:
            live.end(reason, error)
