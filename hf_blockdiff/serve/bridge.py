"""The rows of one request between the engine thread and the event loop (docs/architecture.md, "Server").

`LiveEngine` calls a row's callback from its own thread; `RequestRows` hands each update to the event loop into one
asyncio queue per request, so a handler awaits its rows' updates without a thread of its own. The updates of a step
(one per running row) cross in one wake-up of the loop (`LoopPost`), not one each: every wake-up is a GIL hand-over
between the two threads, and at 128 rows those stalled the engine thread between steps. A handler that fell behind
takes the updates waiting for its row as one (`merged`), so a slow client costs one event, not one per step.
Leaving the `with` block cancels every row still running (the response is done, the client left, the deadline
passed, the server stops): the engine frees their slots at its next step boundary and still sends each its final
update."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
import weakref
from collections.abc import AsyncIterator, Sequence

REQUEST_NUMBERS = itertools.count()  # each request's rows are one group: its samples share the prompt's pages


class LoopPost:
    """Items put into asyncio queues from another thread, delivered by one callback on the loop per batch: a put
    schedules the delivery only when none is pending."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock, self.pending = loop, threading.Lock(), []

    def put(self, queue: asyncio.Queue, item) -> None:
        with self.lock:
            self.pending.append((queue, item))
            if len(self.pending) > 1:
                return
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop has closed: nobody waits for these rows any more
            with self.lock:
                self.pending.clear()

    def _deliver(self) -> None:
        with self.lock:
            items, self.pending = self.pending, []
        for queue, item in items:
            queue.put_nowait(item)


_POSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one LoopPost per event loop


def loop_post(loop: asyncio.AbstractEventLoop) -> LoopPost:
    """The loop's LoopPost (made on the loop's thread, the first time a request asks)."""
    post = _POSTS.get(loop)
    if post is None:
        post = _POSTS[loop] = LoopPost(loop)
    return post


def merged(first, later):
    """Two consecutive RowUpdates of one row as one: the tokens of both, the later one's state."""
    return dataclasses.replace(later, tokens=first.tokens + later.tokens, logprobs=first.logprobs + later.logprobs)


class RequestTimeout(Exception):
    """The request's deadline passed before its rows finished (leaving the `with` block cancels them)."""


class RequestRows:
    """The engine rows of one request (its n choices) and their updates, in the order the engine sent them."""

    def __init__(self, engine, timeout: float | None, metrics):
        self.engine, self.metrics = engine, metrics
        self.post = loop_post(asyncio.get_running_loop())
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
            self.post.put(self.queue, (index, update))

        return deliver

    async def updates(self) -> AsyncIterator[tuple[int, object]]:
        """(choice index, RowUpdate) until every row has sent its final update; RequestTimeout past the deadline."""
        held = None  # an update taken from the queue that did not merge with the one before it
        try:
            while self.running:
                index, update = held or await asyncio.wait_for(self.queue.get(), self._time_left())
                held = None
                while update.finish_reason is None and not self.queue.empty():
                    held = self.queue.get_nowait()
                    if held[0] != index:
                        break
                    update, held = merged(update, held[1]), None
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
