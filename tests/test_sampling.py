"""Sampling: seeded, row-independent, exact distribution; the mask token is never proposed; streamers."""

import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.kernels.scoring import top_p_filter
from hf_blockdiff.strategies.scoring import RowSampling, SamplingParams, score_logits

from helpers import MASK, left_pad, random_prompts

SAMPLING = dict(mask_token_id=MASK, block_size=4, max_new_tokens=12, attention="block_causal", eos_token_id=[],
                temperature=1.0, strategy="low_confidence_dynamic", threshold=0.5)


def sample(model, prompts, seed, **overrides):
    ids, mask = left_pad(prompts)
    cfg = BlockDiffusionConfig(**{**SAMPLING, **overrides})
    out = model.generate_multi_block(ids, cfg, attention_mask=mask, generator=torch.Generator().manual_seed(seed))
    return out[:, ids.shape[1]:]


def test_same_seed_same_output_and_rows_do_not_influence_each_other(qwen3):
    prompts = random_prompts((6, 9, 4), seed=8)
    first = sample(qwen3, prompts, seed=1)
    assert torch.equal(first, sample(qwen3, prompts, seed=1))
    assert not torch.equal(first, sample(qwen3, prompts, seed=2))
    changed = [prompts[0], random_prompts((12,), seed=99)[0], prompts[2]]
    other = sample(qwen3, changed, seed=1)
    assert torch.equal(first[0], other[0]) and torch.equal(first[2], other[2])


def test_identical_prompts_sample_differently(qwen3):
    prompt = random_prompts((6,), seed=3)[0]
    out = sample(qwen3, [prompt] * 4, seed=0)
    assert len({tuple(row.tolist()) for row in out}) > 1


def test_top_k_one_is_greedy(qwen3):
    """Same tokens as greedy with an order that ignores confidence (the filtered confidence of top-k 1 is 1)."""
    prompts = random_prompts((6, 9), seed=8)
    greedy = sample(qwen3, prompts, seed=0, temperature=0.0, strategy="sequential")
    assert torch.equal(sample(qwen3, prompts, seed=5, top_k=1, strategy="sequential"), greedy)
    assert torch.equal(sample(qwen3, prompts, seed=5, top_p=1e-6, strategy="sequential"), greedy)


def test_sampled_tokens_follow_the_softmax():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 8, generator=generator) * 1.5
    n = 20000
    params = SamplingParams(mask_token_id=7, temperature=0.8)
    scores = score_logits(logits.expand(n, 8), params, torch.full((n,), 3), torch.arange(n))
    z = logits[0] / 0.8
    z[7] = float("-inf")
    expected = torch.softmax(z, -1)
    observed = torch.bincount(scores.proposal, minlength=8).float() / n
    assert observed[7] == 0
    assert torch.allclose(observed, expected, atol=0.015)
    torch.testing.assert_close(scores.confidence, expected[scores.proposal])


def test_top_p_keeps_the_smallest_set_reaching_p():
    z = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(top_p_filter(z, 0.75)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(top_p_filter(z, 0.85)).sum() == 3
    assert torch.isfinite(top_p_filter(z, 0.1)).tolist() == [[True, False, False, False]]


def test_mask_token_is_never_proposed(qwen3):
    with torch.no_grad():
        saved = qwen3.lm_head.weight[MASK].clone()
        qwen3.lm_head.weight[MASK] = qwen3.lm_head.weight.abs().max(0).values * 50
    try:
        out = sample(qwen3, random_prompts((6, 9), seed=1), seed=0, temperature=0.0)
        sampled = sample(qwen3, random_prompts((6, 9), seed=1), seed=0)
    finally:
        with torch.no_grad():
            qwen3.lm_head.weight[MASK] = saved
    assert not (out == MASK).any() and not (sampled == MASK).any()


class Recorder:
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_committed_tokens_in_order(qwen3):
    prompt = random_prompts((7,), seed=2)[0]
    recorder = Recorder()
    cfg = BlockDiffusionConfig(**{**SAMPLING, "temperature": 0.0, "max_active_blocks": 2,
                                  "block_add_threshold": 0.5, "decoded_token_threshold": 0.5})
    out = qwen3.generate_multi_block(prompt[None], cfg, streamer=recorder)
    assert recorder.chunks[0] == prompt.tolist() and recorder.ended
    streamed = [t for chunk in recorder.chunks[1:] for t in chunk]
    assert streamed == out[0, len(prompt):].tolist()
    assert len(recorder.chunks) > 2


def test_per_row_settings_score_each_row_as_its_own_settings_would():
    """The per-row path (the live engine's) gives every row the bits the scalar path gives it alone with its own
    temperature, top-k and top-p, greedy rows included, in every confidence mode."""
    generator = torch.Generator().manual_seed(0)
    settings = [(0.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.9, 0, 0.8), (1.1, 12, 0.9), (0.0, 7, 0.5),
                (2.0, 1, 1.0), (0.3, 200, 0.95)]
    logits = torch.randn(len(settings), 96, generator=generator) * 3
    seed, counter = torch.arange(len(settings)) * 7 + 1, torch.arange(len(settings)) + 100
    for confidence in ("filtered", "unfiltered", "raw"):
        rows = RowSampling(*(torch.tensor(values, dtype=dtype) for values, dtype in zip(
            ([1 / t if t > 0 else 0.0 for t, _, _ in settings], [k if t > 0 else 0 for t, k, _ in settings],
             [1 - p if t > 0 else 0.0 for t, _, p in settings]), (torch.float64, torch.long, torch.float64))))
        rows.inverse_temperature, rows.top_p_drop = rows.inverse_temperature.float(), rows.top_p_drop.float()
        batch = score_logits(logits, SamplingParams(MASK, confidence=confidence), seed, counter, rows=rows)
        for row, (temperature, top_k, top_p) in enumerate(settings):
            alone = score_logits(logits[row:row + 1], SamplingParams(MASK, temperature, top_k, top_p, confidence),
                                 seed[row:row + 1], counter[row:row + 1])
            for name in ("proposal", "confidence", "entropy", "margin", "logprob"):
                assert torch.equal(getattr(batch, name)[row:row + 1], getattr(alone, name)), (row, name, confidence)
