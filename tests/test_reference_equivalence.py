"""generate_multi_block against the plain reference loops of tests/reference_loops.py, token for token."""

import math

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from reference_loops import llada_reference, multi_block_reference, sdar_reference

from helpers import MASK, left_pad, random_prompts, tiny_model

NEW = 12
LENGTHS = (8, 5, 11)  # P mod 4 = 0 and ≠ 0; P mod 8 = 0 and ≠ 0


def generate(model, prompts, **config):
    ids, mask = left_pad(prompts)
    out = model.generate_multi_block(ids, BlockDiffusionConfig(mask_token_id=MASK, **config), attention_mask=mask,
                                     return_dict=True)
    return out.sequences[:, ids.shape[1]:], out


def decoded_blocks(prompt_len, block, generated, stop_ids):
    """Blocks the SDAR reference decodes (each costs it a store forward)."""
    first = prompt_len // block
    stops = [i for i, t in enumerate(generated.tolist()) if t in stop_ids]
    last = (prompt_len + stops[0]) // block if stops else math.ceil((prompt_len + NEW) / block) - 1
    return last - first + 1


SDAR_STRATEGIES = [("sequential", "topk"), ("low_confidence_static", "topk"), ("low_confidence_dynamic", "topk"),
                   ("low_confidence_dynamic", "leftmost")]


@pytest.mark.parametrize("strategy,fallback", SDAR_STRATEGIES)
@pytest.mark.parametrize("block,steps", [(4, 4), (8, 8), (8, 4)])
def test_sdar_semantics(qwen3, strategy, fallback, block, steps):
    prompts = random_prompts(LENGTHS, seed=block)
    settings = dict(block_size=block, steps_per_block=steps, max_new_tokens=NEW, strategy=strategy, threshold=0.6,
                    fallback=fallback, attention="block_causal", alignment="absolute", eos_token_id=[])
    reference = [sdar_reference(qwen3, p, MASK, block, steps, NEW, strategy, 0.6, fallback) for p in prompts]
    for fused in (False, True):
        batched, _ = generate(qwen3, prompts, fused_store=fused, **settings)
        for row, prompt in enumerate(prompts):
            alone, out = generate(qwen3, [prompt], fused_store=fused, **settings)
            tokens, forwards = reference[row]
            assert alone[0].tolist() == tokens.tolist()
            assert batched[row].tolist() == tokens.tolist()
            saved = 0 if not fused else decoded_blocks(len(prompt), block, tokens, ())
            assert out.num_forwards == forwards - saved


@pytest.mark.parametrize("fused", [False, True])
def test_sdar_stop_tokens(qwen3, fused):
    prompts = random_prompts(LENGTHS, seed=3)
    settings = dict(block_size=4, max_new_tokens=NEW, strategy="low_confidence_dynamic", threshold=0.6,
                    attention="block_causal", alignment="absolute", fused_store=fused)
    free, _ = generate(qwen3, prompts, eos_token_id=[], **settings)
    stop = int(free[0, 5])  # a token the first row produces mid-way
    pad = 1
    batched, _ = generate(qwen3, prompts, eos_token_id=[stop, 93], pad_token_id=pad, **settings)
    for row, prompt in enumerate(prompts):
        tokens, forwards = sdar_reference(qwen3, prompt, MASK, 4, 4, NEW, "low_confidence_dynamic", 0.6,
                                          stop_ids=(stop, 93), pad=pad)
        alone, out = generate(qwen3, [prompt], eos_token_id=[stop, 93], pad_token_id=pad, **settings)
        assert batched[row].tolist() == tokens.tolist() == alone[0].tolist()
        saved = decoded_blocks(len(prompt), 4, tokens, (stop, 93)) if fused else 0
        assert out.num_forwards == forwards - saved
    assert pad in batched[0].tolist()


@pytest.mark.parametrize("fused", [False, True])
def test_early_stop_off_decodes_past_the_stop_token(qwen3, fused):
    """early_stop=False: every row runs to max_new_tokens and nothing is replaced, as the reference without stop
    ids; with early_stop the same stop id ends the row (pad after it)."""
    prompts = random_prompts(LENGTHS, seed=3)
    settings = dict(block_size=4, max_new_tokens=NEW, strategy="low_confidence_dynamic", threshold=0.6,
                    attention="block_causal", alignment="absolute", fused_store=fused, pad_token_id=1)
    free, _ = generate(qwen3, prompts, eos_token_id=[], **settings)
    stop = int(free[0, 5])
    kept, out = generate(qwen3, prompts, eos_token_id=[stop], early_stop=False, **settings)
    stopped, _ = generate(qwen3, prompts, eos_token_id=[stop], **settings)
    for row, prompt in enumerate(prompts):
        tokens, _ = sdar_reference(qwen3, prompt, MASK, 4, 4, NEW, "low_confidence_dynamic", 0.6)
        assert kept[row].tolist() == tokens.tolist()
    assert not torch.equal(kept, stopped) and 1 in stopped[0].tolist() and 1 not in kept[0].tolist()
    assert (out.commit_step >= 0).all()


def test_early_stop_off_skips_the_eos_fill(qwen3):
    prompts = random_prompts((6, 9), seed=5)
    settings = dict(block_size=4, max_new_tokens=NEW, strategy="entropy_threshold", threshold=0.5,
                    attention="block_causal", alignment="prompt_end", logit_shift=True, max_active_blocks=3,
                    block_add_threshold=0.5, decoded_token_threshold=0.5, eos_fill=True)
    free, _ = generate(qwen3, prompts, eos_token_id=[], **settings)
    stop = int(free[0, 3])
    kept, _ = generate(qwen3, prompts, eos_token_id=[stop], early_stop=False, **settings)
    assert torch.equal(kept, free)
    for row, prompt in enumerate(prompts):
        tokens, _ = multi_block_reference(qwen3, prompt, MASK, 4, NEW, 0.5, 0.5, 0.5, max_active_blocks=3)
        assert kept[row].tolist() == tokens.tolist()


@pytest.mark.parametrize("steps", [4, 2])
@pytest.mark.parametrize("strategy", ["low_confidence_static", "confidence_threshold"])
def test_llada_semantics(qwen3, steps, strategy):
    prompts = random_prompts((6, 3, 9), seed=7)
    settings = dict(block_size=4, steps_per_block=steps, max_new_tokens=NEW, strategy=strategy, threshold=0.6,
                    attention="bidirectional", alignment="prompt_end", eos_token_id=[])
    batched, _ = generate(qwen3, prompts, **settings)
    remasking = "threshold" if strategy == "confidence_threshold" else "low_confidence"
    for row, prompt in enumerate(prompts):
        tokens, forwards = llada_reference(qwen3, prompt, MASK, 4, steps, NEW, remasking, 0.6)
        alone, out = generate(qwen3, [prompt], **settings)
        assert batched[row].tolist() == tokens.tolist() == alone[0].tolist()
        if strategy == "low_confidence_static":
            assert out.num_forwards == forwards == steps * NEW // 4


def test_llada_semantics_with_logit_shift_and_stop(qwen3):
    prompts = random_prompts((6, 3), seed=11)
    settings = dict(block_size=4, max_new_tokens=NEW, strategy="low_confidence_static", attention="bidirectional",
                    alignment="prompt_end", logit_shift=True)
    free, _ = generate(qwen3, prompts, eos_token_id=[], **settings)
    stop = int(free[1, 6])
    batched, _ = generate(qwen3, prompts, eos_token_id=stop, pad_token_id=2, **settings)
    for row, prompt in enumerate(prompts):
        tokens, _ = llada_reference(qwen3, prompt, MASK, 4, 4, NEW, stop_ids=(stop,), pad=2, shift=True)
        assert batched[row].tolist() == tokens.tolist()


@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
@pytest.mark.parametrize("add,decoded,active", [(0.25, 0.5, 8), (0.5, 0.75, 2), (0.0, 0.0, 3)])
def test_multi_block_semantics(qwen3, add, decoded, active, attention):
    """Multi-block rules with the cache (block-causal) and under full recompute of the whole canvas
    (bidirectional, d3LLM's decoders)."""
    prompts = random_prompts((6, 3, 9), seed=5)
    settings = dict(block_size=4, max_new_tokens=14, strategy="entropy_threshold", threshold=1.2,
                    attention=attention, alignment="prompt_end", logit_shift=True, max_active_blocks=active,
                    block_add_threshold=add, decoded_token_threshold=decoded, eos_token_id=[])
    batched, _ = generate(qwen3, prompts, **settings)
    for row, prompt in enumerate(prompts):
        tokens, forwards = multi_block_reference(qwen3, prompt, MASK, 4, 14, 1.2, add, decoded, active,
                                                 bidirectional=attention == "bidirectional")
        alone, out = generate(qwen3, [prompt], **settings)
        assert batched[row].tolist() == tokens.tolist() == alone[0].tolist()
        assert out.num_forwards == forwards + (attention == "block_causal")  # + the prompt's prefill into the cache
        assert out.tokens_per_forward > 1


def test_multi_block_stop(qwen3):
    prompts = random_prompts((6, 3, 9), seed=5)
    settings = dict(block_size=4, max_new_tokens=14, strategy="entropy_threshold", threshold=1.2,
                    attention="block_causal", alignment="prompt_end", logit_shift=True, max_active_blocks=4,
                    block_add_threshold=0.25, decoded_token_threshold=0.5)
    free, _ = generate(qwen3, prompts, eos_token_id=[], **settings)
    stop = int(free[2, 7])
    batched, _ = generate(qwen3, prompts, eos_token_id=stop, pad_token_id=0, **settings)
    for row, prompt in enumerate(prompts):
        tokens, _ = multi_block_reference(qwen3, prompt, MASK, 4, 14, 1.2, 0.25, 0.5, 4, stop_ids=(stop,))
        assert batched[row].tolist() == tokens.tolist()


@pytest.mark.parametrize("alignment", ["absolute", "prompt_end"])
def test_multi_block_with_full_thresholds_equals_single_block(qwen3, alignment):
    prompts = random_prompts(LENGTHS, seed=2)
    settings = dict(block_size=4, max_new_tokens=NEW, strategy="low_confidence_dynamic", threshold=0.6,
                    attention="block_causal", alignment=alignment, eos_token_id=[])
    single, single_out = generate(qwen3, prompts, **settings)
    multi, multi_out = generate(qwen3, prompts, max_active_blocks=3, block_add_threshold=1.0,
                                decoded_token_threshold=1.0, **settings)
    assert multi.tolist() == single.tolist()
    assert multi_out.num_forwards == single_out.num_forwards


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_other_stock_families(family):
    model = tiny_model(family, seed=1)
    prompts = random_prompts((7, 4), seed=1)
    settings = dict(block_size=4, max_new_tokens=8, strategy="low_confidence_dynamic", threshold=0.6,
                    attention="block_causal", alignment="absolute", eos_token_id=[])
    batched, _ = generate(model, prompts, **settings)
    for row, prompt in enumerate(prompts):
        tokens, _ = sdar_reference(model, prompt, MASK, 4, 4, 8, "low_confidence_dynamic", 0.6)
        assert batched[row].tolist() == tokens.tolist()
