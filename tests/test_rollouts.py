"""`num_return_sequences`: the samples of a prompt compute its prefix once and share its K/V pages, and decode exactly
what the prompt repeated `n` times decodes with the same generator (per-row seeds), in every block-causal mode."""

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from helpers import MASK, left_pad, random_prompts, tiny_model

LENGTHS = (13, 22, 9)  # prefixes of 12, 20 and 8 tokens: full shared pages and a copied tail at page size 8
BASE = dict(mask_token_id=MASK, block_size=4, max_new_tokens=10, attention="block_causal", eos_token_id=[],
            page_size=8)
MODES = {
    "greedy threshold": dict(threshold=0.6),
    "sampled, top-k": dict(temperature=1.0, top_k=20, threshold=0.6),
    "separate store forward": dict(threshold=0.6, fused_store=False),
    "multi-block": dict(max_active_blocks=2, block_add_threshold=0.5, decoded_token_threshold=0.5,
                        strategy="entropy_threshold", threshold=1.5),
    "sub-blocks, first token on store": dict(logit_shift=True, block_size=8, sub_block_size=4,
                                             strategy="confidence_threshold", threshold=0.6, fused_store=False,
                                             first_token_on_store=True),
}


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3")


def _both(model, cfg, n, **kwargs):
    ids, mask = left_pad(random_prompts(LENGTHS, seed=4))
    shared = model.generate_multi_block(ids, cfg, attention_mask=mask, num_return_sequences=n, return_dict=True,
                                        generator=torch.Generator().manual_seed(7), **kwargs)
    shared_peak = model._blockdiff_engine.cache.pages.peak
    plain = model.generate_multi_block(ids.repeat_interleave(n, 0), cfg, attention_mask=mask.repeat_interleave(n, 0),
                                       return_dict=True, generator=torch.Generator().manual_seed(7), **kwargs)
    return shared, plain, shared_peak, model._blockdiff_engine.cache.pages.peak


@pytest.mark.parametrize("mode", sorted(MODES))
def test_samples_share_the_prefix_and_decode_as_repeated_prompts(model, mode):
    cfg = BlockDiffusionConfig(**{**BASE, **MODES[mode]})
    shared, plain, shared_peak, plain_peak = _both(model, cfg, n=4)
    assert torch.equal(shared.sequences, plain.sequences)
    for field in ("commit_step", "logprobs", "steps"):
        assert torch.equal(getattr(shared, field), getattr(plain, field)), field
    if "temperature" in MODES[mode]:  # the samples of a prompt differ: each row has its own seed
        assert not torch.equal(shared.sequences[0], shared.sequences[1])
    # pages: each prompt's canvas (pages_for(row_end)), its 3 other samples without the full prefix pages
    row_end = [(n // cfg.block_size * cfg.block_size + -(-(n % cfg.block_size + 10) // cfg.block_size)
                * cfg.block_size) for n in LENGTHS]
    full = [n // cfg.block_size * cfg.block_size // 8 for n in LENGTHS]
    own = [-(-end // 8) for end in row_end]
    assert plain_peak == 4 * sum(own)
    assert shared_peak == sum(own) + 3 * sum(o - f for o, f in zip(own, full))


def test_streamed_samples_reuse_a_prefix_computed_in_an_earlier_admission(model):
    """With 3 slots for 3 × 4 samples a prompt's samples are admitted at different times: later ones take the
    prefix its first sample computed, as long as one of them still holds it."""
    cfg = BlockDiffusionConfig(**BASE, temperature=1.0, threshold=0.6)
    shared, plain, _, _ = _both(model, cfg, n=4, max_batch_size=3)
    assert torch.equal(shared.sequences, plain.sequences)


def test_shared_prefill_computes_each_prefix_once(model):
    """The prefill forward runs the prefix of each prompt once, not once per sample."""
    cfg = BlockDiffusionConfig(**BASE, threshold=0.6)
    ids, mask = left_pad(random_prompts(LENGTHS, seed=4))
    seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda module, args, out: seen.append(args[0].numel()))
    try:
        model.generate_multi_block(ids, cfg, attention_mask=mask, num_return_sequences=4)
        shared_prefill = seen[0]
        seen.clear()
        model.generate_multi_block(ids.repeat_interleave(4, 0), cfg, attention_mask=mask.repeat_interleave(4, 0))
    finally:
        hook.remove()
    assert 4 * shared_prefill == seen[0]


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "4"])
def test_bad_num_return_sequences(model, value):
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(ValueError, match="num_return_sequences"):
        model.generate_multi_block(ids, BlockDiffusionConfig(**BASE), num_return_sequences=value)


def test_streamer_needs_one_sequence(model):
    class Streamer:
        def put(self, value):
            pass

        def end(self):
            pass

    with pytest.raises(ValueError, match="num_return_sequences=1"):
        model.generate_multi_block(torch.tensor([[5, 6, 7]]), BlockDiffusionConfig(**BASE), streamer=Streamer(),
                                   num_return_sequences=2)


def test_sharing_fits_more_samples_in_the_same_budget(model):
    """Under `max_cache_tokens` a slot counts its canvas and a page (64 tokens here) less the shared prefix pages'
    (n-1)/n (30 of the shortest prefix's 40): 256 tokens hold 4 unshared slots, 7 sharing ones; same tokens."""
    ids, mask = left_pad(random_prompts((41, 45), seed=8))
    cfg = BlockDiffusionConfig(**BASE, temperature=1.0, threshold=0.6, max_cache_tokens=256)
    seeded = dict(attention_mask=mask, generator=torch.Generator().manual_seed(2))
    shared = model.generate_multi_block(ids, cfg, num_return_sequences=4, **seeded)
    assert model._blockdiff_engine.state.num_rows == 7
    seeded = dict(attention_mask=mask.repeat_interleave(4, 0), generator=torch.Generator().manual_seed(2))
    plain = model.generate_multi_block(ids.repeat_interleave(4, 0), cfg, **seeded)
    assert model._blockdiff_engine.state.num_rows == 4
    assert torch.equal(shared, plain)
