"""The server's limits and lifecycle: the API key, a full queue and deadlines (on an engine that holds its rows),
text in whole characters before a stop string, a chat template required, the extra named when missing, SIGTERM
finishing the requests in flight, and a handler that fell behind."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
from transformers import AutoTokenizer  # noqa: E402

from hf_blockdiff.assets import demo_model_path  # noqa: E402
from hf_blockdiff.generation.live import RowUpdate  # noqa: E402
from hf_blockdiff.serve.app import Server, create_app  # noqa: E402
from hf_blockdiff.serve.command import limits_of  # noqa: E402

from helpers import free_port, on_python_path  # noqa: E402
from serving import CFG, client, demo, running, wait_for  # noqa: E402,F401  (demo: a fixture)

KEY = "sk-test"


class HeldEngine:
    """A test double of LiveEngine: rows are queued and never decoded; cancel (or close) ends them."""

    slots, running, forwards = 2, 0, 0

    def __init__(self):
        self.rows = []

    @property
    def queue_depth(self):
        return sum(not row.done for row in self.rows)

    def submit(self, prompt, settings, on_update, group=None):
        self.rows.append(HeldRow(on_update))
        return self.rows[-1]

    def start(self):
        pass

    def close(self, cancel=True, timeout=None):
        for row in self.rows:
            row.cancel()


class HeldRow:
    def __init__(self, on_update):
        self.on_update, self.done = on_update, False

    def cancel(self):
        if not self.done:
            self.done = True
            self.on_update(RowUpdate([], [], 0, "cancelled"))


@pytest.fixture(scope="module")
def held(demo):
    """A server over HeldEngine with an API key, a queue of 4 rows and a 1.5 s request timeout: (URL, engine)."""
    model, tokenizer = demo
    engine = HeldEngine()
    server = Server(engine, tokenizer, "demo", limits_of(model, CFG, True), max_queue=4, request_timeout=1.5,
                    api_key=KEY)
    with running(create_app(server)) as url:
        yield url, engine


def test_api_key_queue_and_timeouts(held):
    url, engine = held
    with pytest.raises(openai.AuthenticationError):
        client(url, key="wrong").models.list()
    assert client(url, KEY).models.list().data[0].id == "demo"
    with pytest.raises(openai.APIStatusError) as timeout:  # the deadline: 504, the rows cancelled
        client(url, KEY).completions.create(model="demo", prompt="1+1=", n=2)
    assert timeout.value.status_code == 504 and all(row.done for row in engine.rows)
    stream = client(url, KEY).completions.create(model="demo", prompt="1+1=", n=4, stream=True)  # fills the queue
    wait_for(lambda: engine.queue_depth == 4)
    with pytest.raises(openai.RateLimitError) as full:
        client(url, KEY).completions.create(model="demo", prompt="1+1=")
    assert full.value.response.headers["retry-after"] == "1"
    with pytest.raises(openai.APIError, match="request-timeout"):  # a stream's deadline: an error event
        list(stream)
    assert engine.queue_depth == 0


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges: "é" is two tokens, each alone an incomplete character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_text_comes_in_whole_characters_and_ends_before_a_stop_string():
    from hf_blockdiff.serve.detokenize import ChoiceText

    tokenizer = byte_tokenizer()
    ids = tokenizer("héllo wörld").input_ids
    assert len(ids) == 13
    for stop, expected in [((), "héllo wörld"), (("wö",), "héllo "), (("ld", "lo w"), "hél")]:
        text = ChoiceText(tokenizer, stop)
        pieces = [text.push([token]) for token in ids] + [text.push([], final=True)]
        assert "".join(pieces) == text.text == expected and text.stopped == bool(stop)
        assert not any("\ufffd" in piece for piece in pieces)


def test_chat_needs_a_template(demo):
    from hf_blockdiff.serve.admission import chat_prompt
    from hf_blockdiff.serve.errors import APIError
    from hf_blockdiff.serve.schemas import ChatCompletionRequest

    request = ChatCompletionRequest(model="demo", messages=[{"role": "user", "content": "1+1="}])
    with pytest.raises(APIError) as refused:
        chat_prompt(request, AutoTokenizer.from_pretrained(demo_model_path()))
    assert (refused.value.status, refused.value.param) == (400, "messages")


def test_serve_without_the_extra_names_it(monkeypatch, capsys):
    from hf_blockdiff.cli import main

    for name in [m for m in sys.modules if m.startswith("hf_blockdiff.serve.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "fastapi", None)
    assert main(["serve", "--model", "demo"]) == 2
    assert "pip install 'hf-blockdiff[serve]'" in capsys.readouterr().err


def test_sigterm_finishes_the_requests_in_flight_and_stops():
    port = free_port()
    # the tiny model gains nothing from a second core
    environment = on_python_path({**os.environ, "OMP_NUM_THREADS": "1"}, Path(__file__).parents[1])
    command = [sys.executable, "-m", "hf_blockdiff.cli", "serve", "--model", "demo", "--port", str(port),
               "--max-new-tokens", "32", "--eos-token-id"]  # no stop token: every row runs its max_tokens
    process = subprocess.Popen(command, env=environment, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: reachable(url) or process.poll() is not None, 120)
        assert process.poll() is None, process.stderr.read()
        body = {"model": "demo", "prompt": "rev abcdefghij=", "max_tokens": 32, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as answer:
            lines = answer.iter_lines()
            first = next(line for line in lines if line)
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert first.startswith("data: {") and rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
        assert process.wait(60) in (0, -signal.SIGTERM)
        log = process.stderr.read()
        assert "warmed up in" in log and "the engine is closed" in log
    finally:
        if process.poll() is None:
            process.kill()


def reachable(url) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_a_handler_behind_takes_its_rows_waiting_updates_as_one():
    """Updates waiting in a request's queue reach its handler merged per row, in order (serve/bridge.py): a client
    that fell behind gets one event for several steps, each row's tokens and logprobs whole, its final update last."""
    import asyncio

    from hf_blockdiff.serve.bridge import RequestRows

    sent = [(0, RowUpdate([1], [-0.1], 1, None)), (0, RowUpdate([2], [-0.2], 2, None)),
            (1, RowUpdate([5], [-0.5], 2, None)), (0, RowUpdate([3], [-0.3], 3, "length")),
            (1, RowUpdate([], [], 3, "length"))]

    async def handled():
        rows = RequestRows(engine=None, timeout=None, metrics=None)
        rows.running = {0, 1}
        for item in sent:
            rows.queue.put_nowait(item)
        return [(i, u.tokens, u.logprobs, u.forwards, u.finish_reason) async for i, u in rows.updates()]

    assert asyncio.run(handled()) == [(0, [1, 2], [-0.1, -0.2], 2, None), (1, [5], [-0.5], 2, None),
                                      (0, [3], [-0.3], 3, "length"), (1, [], [], 3, "length")]
