"""DiffusionGemma through generate_multi_block against transformers' own `generate` (an implementation nobody here
wrote), token for token: tiny fp32 models with both attention kinds, batch 1 and a ragged batch, several canvases,
adaptive stopping on and off, stop ids. The compatibility noise (`noise="torch"`) draws torch's generator in
transformers' order, so seeded runs must agree exactly; the fast path's counter noise is checked by feeding the same
noise to transformers' step (its generator calls replaced) and by distribution tests (test_diffusion_gemma_noise.py)."""

from __future__ import annotations

import pytest
import torch

from diffusion_gemma_models import CANVAS, VOCAB, WINDOW, ours, prompts, reference, settings, tiny_diffusion_gemma

import hf_blockdiff.canvas.schedule as canvas_module
from hf_blockdiff import BlockDiffusionConfig, free_cache
from hf_blockdiff.generation.engine import request_seeds
from hf_blockdiff.canvas.schedule import CanvasRules


@pytest.fixture(scope="module", params=["mixed_moe", "single_expert"])
def model(request):
    return tiny_diffusion_gemma(request.param)


@pytest.fixture
def accepted(monkeypatch):
    """Records how many positions each row's entropy bound accepted per step (the test must see several)."""
    counts = []
    original = canvas_module.entropy_bound_accept

    def recording(entropy, bound):
        taken = original(entropy, bound)
        counts.append(taken.sum(-1))
        return taken

    monkeypatch.setattr(canvas_module, "entropy_bound_accept", recording)
    return counts


def tpf(sequences: torch.Tensor, prompt_width: int, steps: torch.Tensor, pad: int | None) -> torch.Tensor:
    new = sequences[:, prompt_width:]
    valid = (new != pad).sum(-1) if pad is not None else torch.full((len(new),), new.shape[1])
    return valid / steps


@pytest.mark.parametrize("lengths", [[11], [5, 17, 9]], ids=["batch1", "ragged"])
@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "no_stopping"])
def test_same_tokens_as_transformers_generate(model, lengths, adaptive, accepted):
    """Adaptive stopping on: stable at once (stability 0) and confident below a mean entropy these models reach;
    off: a confidence no canvas reaches."""
    steps, new_tokens = 6, 3 * CANVAS
    theirs, fields = settings(steps, bound=3.0, confidence=2.5 if adaptive else 1e-30, stability=0 if adaptive else 1)
    ids, mask = prompts(lengths)
    expected = reference(model, ids, mask, new_tokens, theirs, seed=7)
    out = ours(model, ids, mask, new_tokens, fields, seed=7, noise="torch")
    assert max(lengths) > WINDOW  # the sliding layers see only part of the prefix
    assert torch.equal(out.sequences, expected.sequences)
    assert torch.allclose(tpf(out.sequences, ids.shape[1], out.steps, None), expected.tokens_per_forward)
    assert int(torch.stack(accepted).max()) >= 2  # the bound accepts several tokens in a step: tokens depend on it
    full = 3 * steps
    if adaptive:
        assert bool((out.steps < full).any())  # some canvas stopped early
    else:
        assert bool((out.steps == full).all())


def test_stability_rule_stops_canvases():
    """Stability 1 (the argmax repeated over a step) with sharper distributions and a loose bound, so a canvas
    settles; every canvas of several prompts is compared."""
    model = tiny_diffusion_gemma("mixed_moe", logit_scale=40.0)
    theirs, fields = settings(6, bound=10.0, confidence=10.0, stability=1)
    ids, mask = prompts([5, 17, 9])
    expected = reference(model, ids, mask, 3 * CANVAS, theirs, seed=7)
    out = ours(model, ids, mask, 3 * CANVAS, fields, seed=7, noise="torch")
    assert torch.equal(out.sequences, expected.sequences)
    assert bool((out.steps < 18).any())


def test_stop_ids_end_prompts_and_pad_the_rest(model):
    """A stop id taken from a run without one: both sides stop that prompt in the same canvas and pad after it."""
    steps, new_tokens = 5, 3 * CANVAS
    theirs, fields = settings(steps, bound=1.0, confidence=2.5)
    ids, mask = prompts([12, 7])
    free = reference(model, ids, mask, new_tokens, theirs, seed=11).sequences[:, ids.shape[1]:]
    stop = int(free[1, CANVAS + 2])  # a token of prompt 1's second canvas
    expected = reference(model, ids, mask, new_tokens, theirs, seed=11, eos_token_id=stop, pad_token_id=0)
    out = ours(model, ids, mask, new_tokens, fields, seed=11, noise="torch", eos_token_id=stop, pad_token_id=0)
    assert torch.equal(out.sequences, expected.sequences)
    generated = out.sequences[1, ids.shape[1]:]
    first = int((generated == stop).int().argmax())
    assert first < new_tokens - 1 and bool((generated[first + 1:] == 0).all())
    assert torch.allclose(tpf(out.sequences, ids.shape[1], out.steps, 0), expected.tokens_per_forward)


def test_counter_noise_fed_to_transformers_step(model, monkeypatch):
    """The fast path (counter noise) against transformers' loop whose torch.randint / torch.multinomial calls are
    answered with the same counter noise, in its call order (a randint right after a multinomial renoises that
    step; any other starts a canvas): same tokens, batch of two, adaptive stopping on."""
    steps, new_tokens = 5, 3 * CANVAS
    theirs, fields = settings(steps, bound=1.0, confidence=2.5)
    ids, mask = prompts([9, 13])
    out = model.generate_multi_block(ids, BlockDiffusionConfig(max_new_tokens=new_tokens, **fields),
                                     attention_mask=mask, generator=torch.Generator().manual_seed(5))
    noise = canvas_module.CounterNoise(CanvasRules(CANVAS, VOCAB, steps, 1.0, 0.8, 0.4, 1, 2.5),
                                       request_seeds(len(ids), torch.Generator().manual_seed(5)))
    calls = dict(canvas=-1, step=0, sampled=False)

    def randint(low, high, size, device=None, **kwargs):
        if not calls["sampled"]:
            calls.update(canvas=calls["canvas"] + 1, step=0)
        calls["sampled"] = False
        return noise.tokens(torch.full((size[0],), calls["canvas"]), torch.tensor(calls["step"]))

    def multinomial(probs, num_samples, **kwargs):
        calls.update(step=calls["step"] + 1, sampled=True)
        index = torch.full((len(ids),), calls["canvas"])
        return noise.sample(probs.log(), index, torch.tensor(calls["step"]))[:, None]

    monkeypatch.setattr(torch, "randint", randint)
    monkeypatch.setattr(torch, "multinomial", multinomial)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, **theirs)
    assert calls["canvas"] == 2
    assert torch.equal(out, expected.sequences)


# three calls of one bucket: 5, 6 and 5 prompts (6 rows), canvases of 33, 31 and 29 tokens (48 wide)
REUSED_CALLS = [([17, 5, 9, 12, 3], 1), ([6, 11, 4, 8, 15, 2], 2), ([13, 7, 10, 5, 9], 3)]


def test_calls_of_other_batch_sizes_and_lengths_reuse_one_engine():
    """One engine serves calls of other batch sizes and prompt lengths in its bucket, rows past a call's prompts
    and what earlier calls left in the rows changing nothing: with the compatibility noise each call gives
    transformers' tokens (rows past the prompts draw nothing), with the counter noise a fresh engine's;
    `free_cache` drops it."""
    model = tiny_diffusion_gemma("mixed_moe")
    # every prompt's canvas stops before its 4th step in some canvases: a row past the prompts that kept
    # denoising would keep the others stepping
    theirs, fields = settings(4, bound=3.0, confidence=3.0, stability=0)
    fresh = {}  # the later calls on a fresh engine (the first call's engine is fresh)
    for lengths, seed in REUSED_CALLS[1:]:
        free_cache(model)
        fresh[seed] = ours(model, *prompts(lengths, seed), 2 * CANVAS, fields, seed=seed).sequences
    for noise in ("torch", "counter"):
        free_cache(model)
        engines = []
        for lengths, seed in REUSED_CALLS:
            ids, mask = prompts(lengths, seed)
            out = ours(model, ids, mask, 2 * CANVAS, fields, seed=seed, noise=noise)
            engines.append(model._blockdiff_engine)
            if noise == "counter":
                assert seed not in fresh or torch.equal(out.sequences, fresh[seed])
                continue
            expected = reference(model, ids, mask, 2 * CANVAS, theirs, seed=seed)
            assert torch.equal(out.sequences, expected.sequences)
            assert torch.allclose(tpf(out.sequences, ids.shape[1], out.steps, None), expected.tokens_per_forward)
        assert engines[0] is engines[1] is engines[2] and (len(engines[0].rows), engines[0].width) == (6, 48)
    free_cache(model)
    assert model._blockdiff_engine is None
