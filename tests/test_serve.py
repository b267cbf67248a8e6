"""`hf-blockdiff serve` with the real `openai` client against a live server on 127.0.0.1 (uvicorn in a thread),
on the bundled demo model: every answer equals offline `generate_multi_block` of the same prompt, settings and seed,
decoded the same way; bad input is a 400 naming the field and reaches no engine (the server's limits, detokenizing
and shutdown: test_serve_lifecycle.py)."""

import concurrent.futures
import json
import random
import socket
import threading
from dataclasses import dataclass, field

import pytest
import torch

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from hf_blockdiff.generation.live import LiveEngine  # noqa: E402
from hf_blockdiff.integrations.completions import encode  # noqa: E402
from hf_blockdiff.serve.app import Server, create_app  # noqa: E402
from hf_blockdiff.serve.command import limits_of  # noqa: E402

from serving import CFG, client, demo, running, wait_for  # noqa: E402,F401  (demo: a fixture)


@pytest.fixture(scope="module")
def live(demo):
    """A server over the real LiveEngine: (base URL, engine)."""
    model, tokenizer = demo
    limits = limits_of(model, CFG, max_new_tokens_given=True)
    engine = LiveEngine(model, CFG, max_batch_size=8, max_prompt_tokens=limits.max_prompt_tokens,
                        max_new_tokens=limits.max_new_tokens, tokenizer=tokenizer)
    with running(create_app(Server(engine, tokenizer, "demo", limits, max_queue=64, request_timeout=60))) as url:
        yield url, engine


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
