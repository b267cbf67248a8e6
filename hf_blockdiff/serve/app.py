"""The FastAPI app of `hf-blockdiff serve` (docs/architecture.md, "Server"): the routes, the API key, the request
count, and the one path every completion takes: admit the request (a 400 naming the field, or a 429 while the queue is
full), submit its rows to the engine, then stream its chunks or collect its whole response."""

from __future__ import annotations

import asyncio
import hmac
import logging
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .admission import Limits, admit, chat_prompt, completion_prompt, engine_refusal
from .bridge import RequestRows
from .detokenize import ChoiceText
from .errors import APIError, install_handlers
from .metrics import Metrics
from .responses import ChatFormat, ChoiceState, CompletionFormat, Format, choice_updates
from .schemas import ChatCompletionRequest, CompletionRequest, Sampling
from .streaming import HEADERS, MEDIA_TYPE, stream_events
from .warm_up import warm_up

LOG = logging.getLogger("uvicorn.error")  # uvicorn's own log: its lines and ours in one stream
RETRY_AFTER_S = 1  # what a 429 asks the client to wait: rows leave the queue at every engine step
# While serving, a thread waiting for the GIL gets it within this many seconds (Python's default: 5 ms). The engine
# thread wakes from each step's GPU read while the event loop is busy with the streams: at the default it waited
# milliseconds a step for the GIL (docs/benchmarks.md, "Serving under load").
SWITCH_INTERVAL_S = 0.0002


@dataclass(frozen=True)
class Server:
    """What the app serves: a LiveEngine (not started: the app starts it, and closes it on shutdown), the model's
    tokenizer and name, the capacities, and the server's own limits."""

    engine: object
    tokenizer: object
    model_name: str
    limits: Limits
    max_queue: int  # rows waiting for a slot before requests get 429
    request_timeout: float | None  # seconds a request may take (None: no limit)
    api_key: str | None = None
    warm_up: bool = False  # decode a row, then freeze the process's heap, before listening (serve/warm_up.py)


def create_app(server: Server) -> FastAPI:
    metrics = Metrics(server.engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.engine.start()
        if server.warm_up:
            await asyncio.to_thread(warm_up, server.engine, server.limits)
        switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            yield
        finally:  # uvicorn has let the requests in flight finish (or cancelled them): cancel what is left
            sys.setswitchinterval(switch_interval)
            await asyncio.to_thread(server.engine.close, True)
            LOG.info("hf-blockdiff serve: the engine is closed")

    app = FastAPI(title="hf-blockdiff", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_handlers(app)
    app.add_middleware(RequestCounter, metrics=metrics)
    app.include_router(api_routes(server, metrics), dependencies=[Depends(api_key_check(server.api_key))])

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def scrape():
        text, content_type = metrics.exposition()
        return Response(text, media_type=content_type)

    return app


def api_routes(server: Server, metrics: Metrics) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": 0,
                                            "owned_by": "hf-blockdiff"}]}

    @router.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        fmt = CompletionFormat(server.tokenizer, server.model_name, body.wants_logprobs)
        return await answer(server, metrics, body, completion_prompt(body, server.tokenizer), fmt, request)

    @router.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        fmt = ChatFormat(server.tokenizer, server.model_name, body.wants_logprobs)
        return await answer(server, metrics, body, chat_prompt(body, server.tokenizer), fmt, request)

    return router


async def answer(server: Server, metrics: Metrics, body: Sampling, prompt: list[int], fmt: Format,
                 request: Request) -> Response:
    """Admit, submit, then stream or collect: the one path of both endpoints."""
    admitted = admit(body, prompt, server.model_name, server.limits)
    if len(admitted.rows) > server.max_queue:
        raise APIError(400, f"n={body.n}: more rows than this server queues (--max-queue {server.max_queue})", "n")
    if server.engine.queue_depth + len(admitted.rows) > server.max_queue:
        raise APIError(429, f"the queue is full ({server.max_queue} rows wait for a slot): retry later",
                       code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)})
    rows = RequestRows(server.engine, server.request_timeout, metrics)
    try:
        rows.submit(admitted.prompt, admitted.rows)
    except ValueError as error:
        raise engine_refusal(error, body) from None
    except RuntimeError:  # the engine is closing
        raise APIError(503, "the server is shutting down", code="shutting_down") from None
    metrics.prompt_tokens.inc(len(prompt))
    choices = [ChoiceState(ChoiceText(server.tokenizer, body.stop_strings)) for _ in admitted.rows]
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = stream_events(rows, fmt, choices, len(prompt), include_usage, server.request_timeout)
        return StreamingResponse(events, media_type=MEDIA_TYPE, headers=HEADERS)
    return await whole_response(rows, fmt, choices, len(prompt), server.request_timeout, request)


async def whole_response(rows: RequestRows, fmt: Format, choices: list[ChoiceState], prompt_tokens: int,
                         timeout: float | None, request: Request) -> Response:
    """The response once every row finished; a client that disconnects first cancels the rows."""

    async def collect() -> None:
        async for _ in choice_updates(rows, choices, timeout):
            pass

    with rows:
        collecting = asyncio.ensure_future(collect())
        tasks = (collecting, asyncio.ensure_future(disconnected(request)))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
        if not collecting.done():  # the client left: nobody reads an answer
            return Response(status_code=499)
        collecting.result()  # the APIError of a row the engine did not finish, or of the deadline
        return JSONResponse(fmt.response(choices, prompt_tokens))


async def disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def api_key_check(api_key: str | None):
    """The dependency of the /v1 routes: with --api-key, `Authorization: Bearer <key>` or 401."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send the header Authorization: Bearer <key>",
                           code="invalid_api_key")

    return check


class RequestCounter:
    """ASGI middleware: counts answered HTTP requests by route and status (unknown paths as "other")."""

    ROUTES = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.ROUTES else "other"

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)
