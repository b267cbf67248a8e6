"""The rows of one request between the engine thread and the event loop (docs/architecture.md, "Server").

`LiveEngine` calls a row's callback from its own thread; `RequestRows` hands each update to the event loop
(`call_soon_threadsafe`) into one asyncio queue per request, so a handler awaits its rows' updates without a thread
of its own. Leaving the `with` block cancels every row still running (the response is done, the client left, the
deadline passed, the server stops): the engine frees their slots at its next step boundary and still sends each its
final update."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Sequence

REQUEST_NUMBERS = itertools.count()  # each request's rows are one group: its samples share the prompt's pages


class RequestTimeout(Exception):
    """The request's deadline passed before its rows finished (leaving the `with` block cancels them)."""


class RequestRows:
    """The engine rows of one request (its n choices) and their updates, in the order the engine sent them."""

    def __init__(self, engine, timeout: float | None, metrics):
        self.engine, self.metrics = engine, metrics
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.handles: list = []
        self.group = ("request", next(REQUEST_NUMBERS))
        self.running: set[int] = set()
        self.deadline = None if timeout is None else time.monotonic() + timeout

    def submit(self, prompt: Sequence[int], settings: Sequence) -> None:
        """One row per settings; where the engine refuses one (ValueError), the rows submitted before are cancelled
        and the error raised."""
        try:
            for index, row in enumerate(settings):
                self.handles.append(self.engine.submit(prompt, row, self._callback(index), group=self.group))
                self.running.add(index)
        except ValueError:
            self.cancel()
            raise

    def _callback(self, index: int):
        tokens = 0

        def deliver(update) -> None:  # in the engine thread
            nonlocal tokens
            tokens += len(update.tokens)
            self.metrics.observe(update, tokens)
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, update))
            except RuntimeError:  # the event loop has closed: nobody waits for this row any more
                pass

        return deliver

    async def updates(self) -> AsyncIterator[tuple[int, object]]:
        """(choice index, RowUpdate) until every row has sent its final update; RequestTimeout past the deadline."""
        try:
            while self.running:
                index, update = await asyncio.wait_for(self.queue.get(), self._time_left())
                if update.finish_reason is not None:
                    self.running.discard(index)
                yield index, update
        except asyncio.TimeoutError:
            raise RequestTimeout from None

    def _time_left(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def __enter__(self) -> "RequestRows":
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()

    def cancel(self) -> None:
        """Cancel the rows that have not finished (thread-safe in the engine; a finished row ignores it)."""
        for index in self.running:
            self.handles[index].cancel()
