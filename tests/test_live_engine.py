"""The live engine (generation/live.py): rows of mixed prompts and settings, submitted from several threads at
different times, each equal token for token (and in logprobs) to its own offline `generate_multi_block` call;
cancelled rows free their slots; stop strings; bad settings; close() leaves the model as it was."""

import threading
import time

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.generation.live import LiveEngine, RowSettings, row_seeds

from helpers import MASK, Collector, char_tokenizer, random_prompts, tiny_model

STOP = 7
CFG = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, attention="block_causal", strategy="low_confidence_dynamic",
                           threshold=0.6, eos_token_id=[STOP], pad_token_id=90)


@pytest.fixture(scope="module")
def model():
    model = tiny_model("qwen3", seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(3)  # confidences spread around the thresholds
    return model


def offline(model, prompt, settings, request_seed, samples=1, sample=0, tokenizer=None):
    """Row `sample` of the offline call of `prompt` with the row's settings and the request's seed, cut after its
    output (its first stop token, or the stop string): (tokens, logprobs)."""
    given = {name: getattr(settings, name) for name in ("temperature", "top_p", "top_k", "threshold")
             if getattr(settings, name) is not None}
    if settings.stop_strings:
        given.update(stop_strings=list(settings.stop_strings), tokenizer=tokenizer)
    out = model.generate_multi_block(torch.tensor([prompt]), CFG, max_new_tokens=settings.max_new_tokens,
                                     num_return_sequences=samples, return_dict=True,
                                     generator=torch.Generator().manual_seed(request_seed), **given)
    tokens = out.sequences[sample, len(prompt):].tolist()
    length = len(tokens) if (out.commit_step[sample] >= 0).all() else int((out.commit_step[sample] >= 0).sum())
    return tokens[:length], out.logprobs[sample, :length].tolist()


# (prompt length, request seed, samples, which sample, settings beside the seed)
ROWS = [
    (5, 13, 1, 0, dict(max_new_tokens=12, temperature=2.0)),  # twice, in two slots: a seed by slot would differ
    (5, 13, 1, 0, dict(max_new_tokens=12, temperature=2.0)),
    (3, 5, 1, 0, dict(max_new_tokens=8)),
    (14, 7, 2, 1, dict(max_new_tokens=12, temperature=0.9, top_k=5)),
    (6, 3, 1, 0, dict(max_new_tokens=5, temperature=1.3, top_p=0.9, threshold=0.8)),
    (9, 11, 2, 0, dict(max_new_tokens=10, temperature=1.1, top_p=0.95, top_k=20, threshold=0.4, drafts=True)),
    (11, 2, 1, 0, dict(max_new_tokens=7, threshold=0.9)),
]


def test_rows_equal_their_offline_calls_whatever_joins_them(model):
    """Seven rows on three slots: three submitted before start, four from threads while others run; each equals
    its own offline call (a seed that followed the slot, or a setting of another row, would change some)."""
    prompts = random_prompts([row[0] for row in ROWS], seed=4)
    prompts[1] = prompts[0]
    settings = [RowSettings(seed=row_seeds(seed, samples)[sample], **given)
                for _, seed, samples, sample, given in ROWS]
    collectors = [Collector() for _ in ROWS]
    engine = LiveEngine(model, CFG, max_batch_size=3, max_prompt_tokens=16, max_new_tokens=12)
    for i in range(3):  # the first two as samples of one request: they share the prompt's prefix pages
        engine.submit(prompts[i].tolist(), settings[i], collectors[i], group="request" if i < 2 else None)
    engine.start()

    def late(i):
        time.sleep(0.2 * (i - 2))
        engine.submit(prompts[i].tolist(), settings[i], collectors[i])

    threads = [threading.Thread(target=late, args=(i,)) for i in range(3, len(ROWS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    finals = [collector.final() for collector in collectors]
    engine.close()
    assert engine.forwards > 0 and engine.running == 0 and engine.queue_depth == 0
    expected = {}
    for (length, seed, samples, sample, _), prompt, row, collector, final in zip(
            ROWS, prompts, settings, collectors, finals):
        key = (tuple(prompt.tolist()), row, seed, samples, sample)
        if key not in expected:
            expected[key] = offline(model, prompt.tolist(), row, seed, samples, sample)
        tokens, logprobs = expected[key]
        assert collector.tokens == tokens and collector.logprobs == logprobs, (length, seed)
        assert final.finish_reason == ("stop" if STOP in tokens else "length")
        assert all(u.forwards <= final.forwards for u in collector.updates)
        if row.drafts:  # every step's draft holds the tokens committed so far
            committed = []
            for update in collector.updates[:-1]:
                committed += update.tokens
                assert len(update.draft) == row.max_new_tokens and update.draft[:len(committed)] == committed


def test_cancelled_row_frees_its_slot(model):
    engine = LiveEngine(model, CFG, max_batch_size=1, max_prompt_tokens=8, max_new_tokens=12)
    first, second = Collector(), Collector()
    started = threading.Event()

    def on_first(update):
        first(update)
        started.set()

    engine.start()
    handle = engine.submit([1, 2, 3], RowSettings(max_new_tokens=12, seed=1, threshold=1.0), on_first)
    engine.submit([4, 5], RowSettings(max_new_tokens=4, seed=2), second)
    assert started.wait(60)
    handle.cancel()
    handle.cancel()  # twice: still one final update
    assert first.final().finish_reason == "cancelled"
    assert second.final().finish_reason in ("stop", "length")  # the freed slot served it
    engine.close()
    assert second.tokens == offline(model, [4, 5], RowSettings(max_new_tokens=4, seed=2), 0)[0]  # greedy


def test_stop_strings_offline_and_served(model):
    tokenizer = char_tokenizer()
    prompt = random_prompts([6], seed=8)[0].tolist()
    plain = RowSettings(max_new_tokens=12, seed=row_seeds(21, 1)[0], temperature=1.0)
    tokens, _ = offline(model, prompt, plain, 21)
    text = tokenizer.decode(tokens)
    stop = text[3:5]
    cut = next(end for end in range(1, len(tokens) + 1) if stop in tokenizer.decode(tokens[:end]))
    with_stop = RowSettings(max_new_tokens=12, seed=plain.seed, temperature=1.0, stop_strings=(stop,))
    stopped, logprobs = offline(model, prompt, with_stop, 21, tokenizer=tokenizer)
    assert stopped == tokens[:cut] and cut < len(tokens)
    engine = LiveEngine(model, CFG, max_batch_size=2, max_prompt_tokens=8, max_new_tokens=12, tokenizer=tokenizer)
    collector = Collector()
    engine.submit(prompt, with_stop, collector)
    engine.submit(prompt[:3], plain, Collector())
    engine.start()
    assert collector.final().finish_reason == "stop"
    engine.close()
    assert collector.tokens == stopped and collector.logprobs == logprobs
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate_multi_block(torch.tensor([prompt]), CFG, max_new_tokens=4, stop_strings=["ab"])


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", 13), ("max_new_tokens", 0), ("seed", -1), ("temperature", -0.5), ("temperature", float("nan")),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("threshold", 1.5), ("stop_strings", ("",)),
    ("stop_strings", ("ab",)),  # the engine has no tokenizer
])
def test_bad_settings_are_refused_naming_the_field(model, field, value):
    engine = LiveEngine(model, CFG, max_batch_size=1, max_prompt_tokens=8, max_new_tokens=12)
    settings = dict(max_new_tokens=4, seed=0)
    settings[field] = value
    with pytest.raises(ValueError, match=field):
        engine.submit([1, 2], RowSettings(**settings), Collector())
    assert engine.queue_depth == 0


def test_bad_prompts_and_engines_are_refused(model):
    engine = LiveEngine(model, CFG, max_batch_size=1, max_prompt_tokens=8, max_new_tokens=12)
    for prompt in ([], list(range(9)), [1, 500], "hello"):
        with pytest.raises(ValueError, match="prompt"):
            engine.submit(prompt, RowSettings(max_new_tokens=4, seed=0), Collector())
    sequential = LiveEngine(model, CFG.replace(strategy="sequential"), max_batch_size=1, max_prompt_tokens=8,
                            max_new_tokens=12)
    with pytest.raises(ValueError, match="threshold"):
        sequential.submit([1], RowSettings(max_new_tokens=4, seed=0, threshold=0.5), Collector())
    with pytest.raises(ValueError, match="max_batch_size"):
        LiveEngine(model, CFG, max_batch_size=0, max_prompt_tokens=8, max_new_tokens=12)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        LiveEngine(model, CFG, max_batch_size=1, max_prompt_tokens=500, max_new_tokens=100)


def model_fingerprint(model):
    probe = torch.arange(10)[None]
    with torch.no_grad():
        logits = model(probe).logits
    forwards = {name: module.forward for name, module in model.named_modules()}
    return logits, forwards, model.training, model.config._attn_implementation, model._blockdiff_engine


def test_close_cancels_rows_in_flight_and_leaves_the_model_as_it_was(model):
    alone = model.generate_multi_block(torch.tensor([[5, 6]]), CFG, max_new_tokens=4)
    model.train()
    before = model_fingerprint(model)
    engine = LiveEngine(model, CFG, max_batch_size=2, max_prompt_tokens=8, max_new_tokens=12)
    collectors = [Collector() for _ in range(4)]
    for i, collector in enumerate(collectors):
        engine.submit([1, 2, 3 + i], RowSettings(max_new_tokens=12, seed=i, threshold=1.0), collector)
    engine.start()
    while not collectors[0].updates:
        time.sleep(0.01)
    meanwhile = model.generate_multi_block(torch.tensor([[5, 6]]), CFG, max_new_tokens=4)  # an offline call
    engine.close(cancel=True, timeout=60)
    assert all(collector.final().finish_reason in ("cancelled", "stop", "length") for collector in collectors)
    assert collectors[-1].final().finish_reason == "cancelled"  # still queued at close
    after = model_fingerprint(model)
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]
    model.eval()
    assert torch.equal(alone, meanwhile)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([1], RowSettings(max_new_tokens=4, seed=0), Collector())


def test_a_failing_step_fails_its_rows_and_the_engine_serves_on(model, monkeypatch):
    engine = LiveEngine(model, CFG, max_batch_size=1, max_prompt_tokens=8, max_new_tokens=12)
    engine.start()
    while engine._loop is None:
        time.sleep(0.01)
    step, calls = engine._loop.engine.step, []

    def failing_once(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return step(*args)

    monkeypatch.setattr(engine._loop.engine, "step", failing_once)
    failed, served = Collector(), Collector()
    engine.submit([1, 2, 3], RowSettings(max_new_tokens=12, seed=0, threshold=1.0), failed)
    engine.submit([4, 5], RowSettings(max_new_tokens=4, seed=1), served)
    final = failed.final()
    assert final.finish_reason == "error" and "injected" in str(final.error)
    assert served.final().finish_reason in ("stop", "length")
    assert not engine._loop.engine.state.logprob.requires_grad  # steps ran without autograd
    engine.close()
    assert served.tokens == offline(model, [4, 5], RowSettings(max_new_tokens=4, seed=1), 0)[0]  # greedy


def test_close_without_cancel_finishes_the_running_rows(model):
    engine = LiveEngine(model, CFG, max_batch_size=1, max_prompt_tokens=8, max_new_tokens=12)
    running, queued = Collector(), Collector()
    engine.submit([1, 2, 3], RowSettings(max_new_tokens=6, seed=0, threshold=1.0), running)
    engine.submit([4, 5], RowSettings(max_new_tokens=4, seed=1), queued)
    engine.start()
    while not running.updates:
        time.sleep(0.01)
    engine.close(cancel=False, timeout=60)
    assert running.final().finish_reason in ("stop", "length") and queued.final().finish_reason == "cancelled"
    assert running.tokens == offline(model, [1, 2, 3], RowSettings(max_new_tokens=6, seed=0, threshold=1.0), 0)[0]


def test_steps_launched_ahead_of_the_reports_change_nothing(model, monkeypatch):
    """The row loop launches a step before reporting the one before where the host can decide nothing between them
    (generation/rows.py, `advance`). An offline call whose rows wait for slots equals the same call with every step
    launched after the host's decisions: tokens, commit steps, logprobs and forwards (a step launched ahead of a
    row's finish, or of a free slot's admission, would take a forward more)."""
    from hf_blockdiff.generation import rows as rows_module

    ids = torch.stack(random_prompts([6] * 5, seed=9))
    cfg = CFG.replace(max_new_tokens=16, max_batch_size=2, temperature=0.7)
    ahead = []
    launch = rows_module.RowLoop._nothing_to_decide
    monkeypatch.setattr(rows_module.RowLoop, "_nothing_to_decide",
                        lambda self, slots: ahead.append(launch(self, slots)) or ahead[-1])

    def call():
        return model.generate_multi_block(ids, cfg, return_dict=True, generator=torch.Generator().manual_seed(3))

    launched = call()
    assert any(ahead)
    monkeypatch.setattr(rows_module.RowLoop, "_nothing_to_decide", lambda self, slots: False)
    after = call()
    for name in ("sequences", "commit_step", "logprobs"):
        assert torch.equal(getattr(launched, name), getattr(after, name)), name
    assert launched.num_forwards == after.num_forwards


def first_admission(model, monkeypatch, gap_s, pause_s, rows=2, slots=4):
    """An idle engine given `rows` rows, `pause_s` apart, with burst gap `gap_s`: (rows the first step held, seconds
    from the last submission to that step)."""
    from hf_blockdiff.generation import live

    monkeypatch.setattr(live, "BURST_GAP_S", gap_s)
    monkeypatch.setattr(live, "BURST_MAX_S", 10 * gap_s)
    engine = LiveEngine(model, CFG, max_batch_size=slots, max_prompt_tokens=8, max_new_tokens=4)
    engine.start()
    while engine._loop is None:
        time.sleep(0.01)
    loop, seen = engine._loop, []
    advance = loop.advance
    monkeypatch.setattr(loop, "advance", lambda: seen.append((len(loop.queue), time.monotonic())) or advance())
    collectors = [Collector() for _ in range(rows)]
    for i, collector in enumerate(collectors):
        time.sleep(pause_s if i else 0)
        engine.submit([1 + i, 2, 3], RowSettings(max_new_tokens=4, seed=i), collector)
        submitted = time.monotonic()
    for collector in collectors:
        assert collector.final().finish_reason in ("stop", "length")
    engine.close()
    return seen[0][0], seen[0][1] - submitted


def test_an_idle_engine_admits_a_burst_at_once(model, monkeypatch):
    """Rows arriving within the burst gap of each other join the idle engine's first admission; a row arriving after
    the gap waits for the next; a full batch starts without waiting out the gap."""
    assert first_admission(model, monkeypatch, gap_s=1.0, pause_s=0.3)[0] == 2
    assert first_admission(model, monkeypatch, gap_s=0.05, pause_s=0.5)[0] == 1
    held, waited = first_admission(model, monkeypatch, gap_s=5.0, pause_s=0.0, rows=2, slots=2)
    assert held == 2 and waited < 2.0
