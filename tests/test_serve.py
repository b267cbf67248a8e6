"""`hf-blockdiff serve` with the real `openai` client against live servers on 127.0.0.1 (uvicorn in a thread; one
subprocess for SIGTERM), on the bundled demo model: every answer equals offline `generate_multi_block` of the same
prompt, settings and seed, decoded the same way; bad input is a 400 naming the field and reaches no engine."""

import concurrent.futures
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
import uvicorn  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from hf_blockdiff.assets import demo_model_path  # noqa: E402
from hf_blockdiff.config import BlockDiffusionConfig  # noqa: E402
from hf_blockdiff.generation.live import LiveEngine, RowUpdate, row_seeds  # noqa: E402
from hf_blockdiff.integrations.completions import encode  # noqa: E402
from hf_blockdiff.serve.app import Server, create_app  # noqa: E402
from hf_blockdiff.serve.command import limits_of  # noqa: E402

CFG = BlockDiffusionConfig(strategy="low_confidence_dynamic", threshold=0.9, max_new_tokens=32)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %} {% endif %}{% endfor %}"
KEY = "sk-test"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo model and a copy of its tokenizer with a chat template (its vocabulary: digits, letters, + = space)."""
    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(demo_model_path())
    tokenizer.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("chat-tokenizer")
    tokenizer.save_pretrained(path)
    return model, AutoTokenizer.from_pretrained(path)


@contextmanager
def running(app):
    """The app served by uvicorn in a thread on a free port of 127.0.0.1: its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def live(demo):
    """A server over the real LiveEngine: (base URL, engine)."""
    model, tokenizer = demo
    limits = limits_of(model, CFG, max_new_tokens_given=True)
    engine = LiveEngine(model, CFG, max_batch_size=8, max_prompt_tokens=limits.max_prompt_tokens,
                        max_new_tokens=limits.max_new_tokens, tokenizer=tokenizer)
    with running(create_app(Server(engine, tokenizer, "demo", limits, max_queue=64, request_timeout=60))) as url:
        yield url, engine


def client(url, key="none", **options):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, **options)


@dataclass
class Expected:
    text: str
    finish_reason: str
    tokens: list
    logprobs: list = field(repr=False)
    steps: int = 0  # the row's decoding steps (usage.forwards sums them over the choices)


def offline(demo, prompt_ids, n=1, seed=0, max_tokens=32, stop=(), **sampling) -> list[Expected]:
    """The rows of offline generate_multi_block for one request, cut after the first stop token, decoded with
    the special tokens skipped and cut before the first stop string."""
    model, tokenizer = demo
    keywords = {k: v for k, v in sampling.items() if v is not None}
    if stop:
        keywords.update(stop_strings=list(stop), tokenizer=tokenizer)
    out = model.generate_multi_block(torch.tensor([prompt_ids]), CFG, max_new_tokens=max_tokens, return_dict=True,
                                     num_return_sequences=n, generator=torch.Generator().manual_seed(seed), **keywords)
    rows = []
    for row in range(n):
        kept = int((out.commit_step[row] >= 0).sum())
        tokens = out.sequences[row, len(prompt_ids):len(prompt_ids) + kept].tolist()
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [text.find(s) for s in stop if s in text]
        finish = "stop" if cuts or tokens[-1:] == [model.config.eos_token_id] else "length"
        rows.append(Expected(text[:min(cuts)] if cuts else text, finish, tokens, out.logprobs[row, :kept].tolist(),
                             int(out.steps[row])))
    return rows


def test_completion_equals_offline_with_logprobs(live, demo):
    url, _ = live
    answer = client(url).completions.create(model="demo", prompt="87+15=", max_tokens=8, logprobs=0, seed=3)
    [expected] = offline(demo, encode("87+15=", demo[1]), seed=3, max_tokens=8)
    choice = answer.choices[0]
    assert (choice.text, choice.finish_reason) == (expected.text, expected.finish_reason)
    assert choice.logprobs.tokens == [demo[1].decode([t]) for t in expected.tokens]
    assert choice.logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (6, len(expected.tokens))
    assert answer.usage.total_tokens == 6 + len(expected.tokens)
    assert answer.usage.model_extra["forwards"] == expected.steps


def test_chat_n_samples_and_stream_equal_offline(live, demo):
    """Chat through the template, n = 3 sampled rows seeded by row_seeds, streamed and whole alike."""
    url, _ = live
    messages = [{"role": "user", "content": "zq xv"}]  # no task of the model's: the samples differ
    ids = encode(messages, demo[1], chat=True)
    expected = offline(demo, ids, n=3, seed=11, temperature=1.5, max_tokens=16)
    assert len({e.text for e in expected}) > 1
    whole = client(url).chat.completions.create(model="demo", messages=messages, n=3, seed=11, temperature=1.5,
                                                max_completion_tokens=16, logprobs=True)
    assert [c.message.content for c in whole.choices] == [e.text for e in expected]
    assert [c.finish_reason for c in whole.choices] == [e.finish_reason for e in expected]
    assert [[t.logprob for t in c.logprobs.content] for c in whole.choices] == \
        [pytest.approx(e.logprobs, abs=1e-5) for e in expected]
    texts, finish = ["", "", ""], [None] * 3
    for chunk in client(url).chat.completions.create(model="demo", messages=messages, n=3, seed=11, temperature=1.5,
                                                     max_tokens=16, stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finish[choice.index] = choice.finish_reason or finish[choice.index]
    assert texts == [e.text for e in expected] and finish == [e.finish_reason for e in expected]


def test_stream_stop_strings_and_usage(live, demo):
    """Committed text only, in order; a stop string ends the text before it; the usage chunk comes last."""
    url, _ = live
    prompt = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]  # token ids: a prompt the model continues at length
    [free] = offline(demo, prompt, seed=5, temperature=1.0)
    stop = free.text[3:5]
    [expected] = offline(demo, prompt, seed=5, temperature=1.0, stop=(stop,))
    chunks = list(client(url).completions.create(model="demo", prompt=prompt, seed=5, temperature=1.0, stop=stop,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text and stop not in text and chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(prompt)


def test_drafts_come_only_when_asked(live, demo):
    """`"blockdiff": {"drafts": true}` adds each step's provisional output (mask id where undecided) to its chunk;
    the committed text is the same."""
    url, _ = live
    body = dict(model="demo", prompt="rev abcdefg=", max_tokens=12, seed=2, stream=True)
    plain = list(client(url).completions.create(**body))
    drafted = list(client(url).completions.create(**body, extra_body={"blockdiff": {"drafts": True}}))
    assert not any("draft" in chunk.choices[0].model_extra for chunk in plain)
    drafts = [chunk.choices[0].model_extra["draft"] for chunk in drafted if "draft" in chunk.choices[0].model_extra]
    masks = [draft.count(demo[0].config.mask_token_id) for draft in drafts]
    assert masks[0] > 0 and masks == sorted(masks, reverse=True)
    assert "".join(c.choices[0].text for c in drafted) == "".join(c.choices[0].text for c in plain)


def request_mix(demo, count=32, seed=0):
    """Mixed requests: prompt lengths 1 to 32 (the server's longest), greedy and sampled, top-p, top-k, thresholds,
    stop strings, n, chat, streams."""
    from hf_blockdiff.tools.tasks import make_problems

    rng = random.Random(seed)
    problems = [p for p, _ in make_problems(count, seed=5)]
    mix = []
    for index in range(count):
        chat = index % 4 == 3
        prompt = problems[index] if index % 2 else [rng.randrange(4, 43) for _ in range(rng.randint(1, 32))]
        ids = encode([{"role": "user", "content": prompt}], demo[1], chat=True) if chat else \
            encode(prompt, demo[1])
        sampling = dict(temperature=rng.choice([None, 0.0, 0.7, 1.5]), top_p=rng.choice([None, 0.9]),
                        top_k=rng.choice([None, 4]), threshold=rng.choice([None, 0.7]))
        mix.append(dict(chat=chat, prompt=prompt, ids=ids, n=rng.choice([1, 1, 2]), seed=rng.randrange(2**31),
                        max_tokens=rng.randint(1, 32), stream=index % 3 == 0,
                        stop=rng.choice([None, None, "1", "e"]), sampling=sampling))
    return mix


def ask(openai_client, request) -> list[tuple[str, str, list]]:
    """(text, finish reason, logprobs) of each choice of one request, streamed or whole."""
    sampling = request["sampling"]
    common = dict(model="demo", n=request["n"], seed=request["seed"], stop=request["stop"],
                  max_tokens=request["max_tokens"], stream=request["stream"], temperature=sampling["temperature"],
                  top_p=sampling["top_p"], extra_body={"top_k": sampling["top_k"],
                                                       "blockdiff": {"threshold": sampling["threshold"]}})
    if request["chat"]:
        answer = openai_client.chat.completions.create(messages=[{"role": "user", "content": request["prompt"]}],
                                                       logprobs=True, **common)
        take = lambda c: ((c.delta.content if request["stream"] else c.message.content) or "",  # noqa: E731
                          [t.logprob for t in c.logprobs.content] if c.logprobs else [])
    else:
        answer = openai_client.completions.create(prompt=request["prompt"], logprobs=0, **common)
        take = lambda c: (c.text, c.logprobs.token_logprobs if c.logprobs else [])  # noqa: E731
    choices = [["", None, []] for _ in range(request["n"])]
    for chunk in (answer if request["stream"] else [answer]):
        for choice in chunk.choices:
            text, logprobs = take(choice)
            choices[choice.index][0] += text
            choices[choice.index][1] = choice.finish_reason or choices[choice.index][1]
            choices[choice.index][2] += logprobs
    return [tuple(c) for c in choices]


def test_32_concurrent_clients_each_get_their_offline_answer(live, demo):
    url, engine = live
    mix = request_mix(demo)
    shared = client(url, http_client=httpx.Client(limits=httpx.Limits(max_connections=32), timeout=120))
    forwards, row_steps = engine.forwards, metric(url, "hf_blockdiff_row_forwards_total")
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda request: ask(shared, request), mix))
    # the rows shared forwards: the engine ran fewer than their steps
    assert engine.forwards - forwards < metric(url, "hf_blockdiff_row_forwards_total") - row_steps
    assert metric(url, 'hf_blockdiff_requests_total{endpoint="/v1/chat/completions",status="200"}') >= 8
    assert metric(url, "hf_blockdiff_tokens_per_forward") > 1 and metric(url, "hf_blockdiff_slots") == engine.slots
    assert metric(url, "hf_blockdiff_slot_occupancy") == metric(url, "hf_blockdiff_queue_depth") == 0
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    for request, answer in zip(mix, answers):
        stop = (request["stop"],) if request["stop"] else ()
        expected = offline(demo, request["ids"], request["n"], request["seed"], request["max_tokens"], stop,
                           **request["sampling"])
        assert [(text, finish) for text, finish, _ in answer] == [(e.text, e.finish_reason) for e in expected], \
            request
        for (_, _, logprobs), e in zip(answer, expected):
            assert logprobs == pytest.approx(e.logprobs, abs=1e-5), request


def metric(url, name) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_its_slot(live, demo, stream):
    """A client that disconnects before its answer (mid-stream, or waiting for a whole response) cancels its row; the
    slot serves the next request."""
    url, engine = live
    model, _ = demo
    gate = threading.Event()
    hold = model.model.register_forward_pre_hook(lambda *_: gate.wait(30) and None)  # the engine waits at a forward
    cancelled = 'hf_blockdiff_rows_total{finish_reason="cancelled"}'
    before = metric(url, cancelled)
    body = json.dumps({"model": "demo", "prompt": list(range(4, 30)), "max_tokens": 32, "stream": stream}).encode()
    try:
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                               b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_for(lambda: engine.running + engine.queue_depth == 1)
    finally:  # the connection is closed: the server cancels the row; the engine goes on
        gate.set()
        hold.remove()
    wait_for(lambda: metric(url, cancelled) == before + 1 and engine.running == engine.queue_depth == 0)
    assert client(url).completions.create(model="demo", prompt="20+0=", max_tokens=4).choices[0].text


def wait_for(condition, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


BAD = [  # (body, param) -> 400 naming param
    ('{"model": "demo", "prompt": "1+1="', None),  # not JSON
    ('[1, 2]', None),  # not an object
    ('{"model": "other", "prompt": "1+1="}', "model"),
    ('{"model": "demo", "prompt": "1+1=", "max_tokens": 60}', "max_tokens"),
    ('{"model": "demo", "prompt": "1+1=", "max_tokens": "8"}', "max_tokens"),
    ('{"model": "demo", "prompt": "1+1=", "n": 0}', "n"),
    ('{"model": "demo", "prompt": "1+1=", "n": 65}', "n"),  # more rows than the queue holds
    ('{"model": "demo", "prompt": "1+1=", "temperature": 2.5}', "temperature"),
    ('{"model": "demo", "prompt": "1+1=", "top_p": 0}', "top_p"),
    ('{"model": "demo", "prompt": [5, 48]}', "prompt"),  # outside the vocabulary (the engine refuses it)
    ('{"model": "demo", "prompt": ""}', "prompt"),
    ('{"model": "demo", "prompt": "%s"}' % ("1" * 33), "prompt"),  # longer than the engine's 32 prompt tokens
    ('{"model": "demo", "prompt": "1+1=", "n": 2, "blockdiff": {"threshold": 5.0}}', "blockdiff.threshold"),
    ('{"model": "demo", "prompt": "1+1=", "logprobs": 2}', "logprobs"),
    ('{"model": "demo", "prompt": "1+1=", "stop": ""}', "stop"),
    ('{"model": "demo", "prompt": "1+1=", "blockdiff": {"drafts": true}}', "blockdiff.drafts"),
    ('{"model": "demo", "prompt": "1+1=", "blockdiff": {"threshold": "high"}}', "blockdiff.threshold"),
    ('{"model": "demo", "prompt": "1+1=", "frequency_penalty": 1}', "frequency_penalty"),
    ('{"model": "demo", "messages": [{"role": "user", "content": 5}]}', "messages.[0].content"),
    ('{"model": "demo", "messages": [], "top_logprobs": 2}', "messages"),
    ('{"model": "demo", "messages": [{"role": "user", "content": "1"}], "top_logprobs": 2}', "top_logprobs"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[f"{p}:{b[:40]}" for b, p in BAD])
def test_bad_requests_are_400_naming_the_field(live, body, param):
    url, engine = live
    endpoint = "chat/completions" if '"messages"' in body else "completions"
    answer = httpx.post(f"{url}/v1/{endpoint}", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert engine.queue_depth == engine.running == 0  # nothing was queued


# --- the API key, a full queue and deadlines, on an engine that holds every row until it is cancelled -------------

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
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {**os.environ, "OMP_NUM_THREADS": "1",  # the tiny model gains nothing from a second core
                   "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
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
        assert "the engine is closed" in process.stderr.read()
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
