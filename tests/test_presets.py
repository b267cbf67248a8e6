"""Every preset token for token against a plain re-implementation of its reference loop (batch 1 and a padded
batch), RL outputs, forward counts that strategies determine, and preset errors."""

from contextlib import contextmanager

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.generation.engine import request_seeds
from hf_blockdiff.kernels.rng import gumbel_noise
from reference_loops import llada_reference, multi_block_reference, sdar_reference
from reference_presets import dream_reference, fast_dllm_reference, fast_dllm_v2_reference

from helpers import MASK, left_pad, random_prompts

PROMPTS = (8, 5, 11)


def generate(model, prompts, cfg, **kwargs):
    ids, mask = left_pad(prompts)
    out = model.generate_multi_block(ids, cfg, attention_mask=mask, return_dict=True, **kwargs)
    return out.sequences[:, ids.shape[1]:], out


def check(model, prompts, cfg, reference, forwards=True):
    """Batched and single-row outputs equal the reference; single-row forward counts too."""
    batched, _ = generate(model, prompts, cfg)
    for row, prompt in enumerate(prompts):
        tokens, count = reference(prompt)
        alone, out = generate(model, [prompt], cfg)
        assert alone[0].tolist() == tokens.tolist()
        assert batched[row].tolist() == tokens.tolist()
        if forwards:
            assert out.num_forwards == count


def test_sdar_preset(qwen3):
    cfg = BlockDiffusionConfig.from_preset("sdar", mask_token_id=MASK, block_size=4, max_new_tokens=12, threshold=0.6,
                                           eos_token_id=[])
    check(qwen3, random_prompts(PROMPTS, 1), cfg,
          lambda p: sdar_reference(qwen3, p, MASK, 4, 4, 12, "low_confidence_dynamic", 0.6))


def test_dllm_var_preset(qwen3):
    """The sdar loop whose prefilled prompt blocks see each other (prompts 8 and 11: two whole blocks)."""
    cfg = BlockDiffusionConfig.from_preset("dllm_var", mask_token_id=MASK, block_size=4, max_new_tokens=12,
                                           threshold=0.6, eos_token_id=[])
    check(qwen3, random_prompts(PROMPTS, 1), cfg, lambda p: sdar_reference(
        qwen3, p, MASK, 4, 4, 12, "low_confidence_dynamic", 0.6, whole_prompt=True))


@pytest.mark.parametrize("remasking", ["low_confidence", "random"])
def test_llada_preset_greedy(qwen3, remasking):
    strategy = "low_confidence_static" if remasking == "low_confidence" else "random"
    cfg = BlockDiffusionConfig.from_preset("llada", mask_token_id=MASK, block_size=4, max_new_tokens=12,
                                           steps_per_block=2, strategy=strategy, eos_token_id=[])
    if remasking == "random":  # the positions are random: equal runs, every position decided, 2 steps per block
        first, out = generate(qwen3, random_prompts(PROMPTS, 2), cfg, generator=torch.Generator().manual_seed(3))
        again, _ = generate(qwen3, random_prompts(PROMPTS, 2), cfg, generator=torch.Generator().manual_seed(3))
        assert torch.equal(first, again) and not (first == MASK).any() and out.num_forwards == 6
        return
    check(qwen3, random_prompts(PROMPTS, 2), cfg, lambda p: llada_reference(qwen3, p, MASK, 4, 2, 12))


def llada_noise(seed: int):
    seeds = request_seeds(1, torch.Generator().manual_seed(seed))

    def noise(position, draw):
        return gumbel_noise(seeds, torch.tensor([position * 65599 + draw]), 96)[0]

    return noise


@pytest.mark.parametrize("cfg_scale", [0.0, 1.5])
def test_llada_preset_sampling_and_guidance(qwen3, cfg_scale):
    cfg = BlockDiffusionConfig.from_preset("llada", mask_token_id=MASK, block_size=4, max_new_tokens=8,
                                           temperature=0.7, cfg_scale=cfg_scale, eos_token_id=[])
    for prompt in random_prompts((6, 9), 4):
        tokens, count = llada_reference(qwen3, prompt, MASK, 4, 4, 8, temperature=0.7, noise=llada_noise(11),
                                        cfg_scale=cfg_scale)
        out = qwen3.generate_multi_block(prompt[None], cfg, generator=torch.Generator().manual_seed(11),
                                         return_dict=True)
        assert out.sequences[0, len(prompt):].tolist() == tokens.tolist()
        assert out.num_forwards == count


@pytest.mark.parametrize("alg", ["entropy", "maskgit_plus", "topk_margin"])
def test_dream_preset(qwen3, alg):
    cfg = BlockDiffusionConfig.from_preset("dream", mask_token_id=MASK, max_new_tokens=10, steps_per_block=6,
                                           strategy=alg, eos_token_id=[])
    check(qwen3, random_prompts(PROMPTS, 3), cfg, lambda p: dream_reference(qwen3, p, MASK, 10, 6, alg))


@pytest.mark.parametrize("cache", ["dual", "prefix"])
def test_fast_dllm_preset(qwen3, cache):
    cfg = BlockDiffusionConfig.from_preset("fast_dllm", mask_token_id=MASK, block_size=4, max_new_tokens=12,
                                           threshold=0.6, approx_cache=cache, eos_token_id=[])
    check(qwen3, random_prompts(PROMPTS, 5), cfg, lambda p: fast_dllm_reference(qwen3, p, MASK, 4, 12, 0.6, cache))


def test_fast_dllm_factor_rule(qwen3):
    cfg = BlockDiffusionConfig.from_preset("fast_dllm", mask_token_id=MASK, block_size=4, max_new_tokens=12,
                                           strategy="confidence_factor", factor=1.0, approx_cache="dual",
                                           eos_token_id=[])
    out, result = generate(qwen3, random_prompts(PROMPTS, 5), cfg)
    assert not (out == MASK).any() and result.tokens_per_forward > 1


@pytest.mark.parametrize("prompt_lengths", [(8, 5, 11), (4, 12)])
def test_fast_dllm_v2_preset(qwen3, prompt_lengths):
    cfg = BlockDiffusionConfig.from_preset("fast_dllm_v2", mask_token_id=MASK, block_size=8, sub_block_size=4,
                                           max_new_tokens=13, threshold=0.6, eos_token_id=[])
    check(qwen3, random_prompts(prompt_lengths, 6), cfg,
          lambda p: fast_dllm_v2_reference(qwen3, p, MASK, 8, 4, 13, 0.6))


def test_fast_dllm_v2_preset_stop(qwen3):
    prompts = random_prompts((8, 5, 11), 6)
    cfg = BlockDiffusionConfig.from_preset("fast_dllm_v2", mask_token_id=MASK, block_size=8, sub_block_size=4,
                                           max_new_tokens=13, threshold=0.6, eos_token_id=[])
    free, _ = generate(qwen3, prompts, cfg)
    stop = int(free[1, 4])
    batched, _ = generate(qwen3, prompts, cfg.replace(eos_token_id=[stop], pad_token_id=0))
    for row, prompt in enumerate(prompts):
        tokens, _ = fast_dllm_v2_reference(qwen3, prompt, MASK, 8, 4, 13, 0.6, stop_ids=(stop,))
        assert batched[row].tolist() == tokens.tolist()


@contextmanager
def attention_profile(model, attention):
    """The model's profile says `attention`, as a released checkpoint's config would, for the block's duration."""
    model.config.diffusion_attention = attention
    try:
        yield
    finally:
        del model.config.diffusion_attention


def d3llm_reference(model, attention, prefill, **rules):
    """d3LLM's multi-block loop (tests/reference_loops.py) with the presets' thresholds, forwards counted as the
    decoder counts them: block-causal models also prefill the prompt into the cache."""
    def reference(prompt):
        tokens, forwards = multi_block_reference(model, prompt, MASK, 4, 16, block_add_threshold=0.5,
                                                 decoded_token_threshold=0.5, activation_on_add=0.5, eos_fill=True,
                                                 bidirectional=attention == "bidirectional", **rules)
        return tokens, forwards + prefill

    return reference


@pytest.mark.parametrize("stop", [False, True])
@pytest.mark.parametrize("attention", ["block_causal", "bidirectional"])
def test_d3llm_preset(qwen3, attention, stop):
    """The preset follows the model's attention: bidirectional models recompute the whole canvas (d3LLM's Dream
    decoder), block-causal ones decode the same rules with the cache."""
    prompts = random_prompts((6, 3, 9), 7)
    cfg = BlockDiffusionConfig.from_preset("d3llm", mask_token_id=MASK, block_size=4, max_new_tokens=16,
                                           threshold=1.2, eos_token_id=[])
    with attention_profile(qwen3, attention):
        stop_ids = ()
        if stop:
            free, _ = generate(qwen3, prompts, cfg)
            stop_ids = (int(free[0, 6]),)
            cfg = cfg.replace(eos_token_id=list(stop_ids))
        reference = d3llm_reference(qwen3, attention, int(attention == "block_causal"), threshold=1.2,
                                    stop_ids=stop_ids)
        check(qwen3, prompts, cfg, reference)
        if stop:
            batched, _ = generate(qwen3, prompts, cfg)
            assert stop_ids[0] in batched[0].tolist()


D3LLM_LLADA = dict(mask_token_id=MASK, block_size=4, max_new_tokens=16, threshold=0.8, eos_token_id=[])


@pytest.mark.parametrize("scope", ["all_active", "lowest_full_block"])
def test_d3llm_llada_preset(qwen3, scope):
    """d3LLM's LLaDA decoder: {H ≤ τ}, no logit shift, and (all_active) the lowest H of all active blocks when none
    passes; at τ = 0.8 tokens pass and tokens are forced."""
    prompts = random_prompts((6, 3, 9), 7)
    cfg = BlockDiffusionConfig.from_preset("d3llm_llada", forced_token_scope=scope, **D3LLM_LLADA)
    reference = d3llm_reference(qwen3, "bidirectional", 0, threshold=0.8, shift=False, strict=False,
                                slot_top1=scope == "all_active")
    with attention_profile(qwen3, "bidirectional"):
        check(qwen3, prompts, cfg, reference)
        _, out = generate(qwen3, prompts, cfg)
    committed = out.entropies[out.commit_step >= 1]
    assert (committed <= 0.8).any() and (committed > 0.8).any()


def test_d3llm_llada_forced_token_saves_forwards(qwen3):
    """Forcing over all active blocks (d3LLM's LLaDA decoder) takes fewer forwards than forcing in the lowest fully
    activated block only, and than the d3llm (Dream decoder) preset at the same threshold."""
    prompts = random_prompts((6, 3, 9), 7)
    forwards = {}
    with attention_profile(qwen3, "bidirectional"):
        for name, scope in (("d3llm_llada", "all_active"), ("d3llm_llada", "lowest_full_block"),
                            ("d3llm", "lowest_full_block")):
            cfg = BlockDiffusionConfig.from_preset(name, forced_token_scope=scope, **D3LLM_LLADA)
            forwards[name, scope] = [generate(qwen3, [prompt], cfg)[1].num_forwards for prompt in prompts]
    llada = forwards["d3llm_llada", "all_active"]
    assert all(a <= b for a, b in zip(llada, forwards["d3llm_llada", "lowest_full_block"]))
    assert sum(llada) < sum(forwards["d3llm_llada", "lowest_full_block"])
    assert sum(llada) < sum(forwards["d3llm", "lowest_full_block"])


def test_rl_outputs_match_the_reference(qwen3):
    prompt = random_prompts((7,), 9)[0]
    cfg = BlockDiffusionConfig.from_preset("sdar", mask_token_id=MASK, block_size=4, max_new_tokens=12, threshold=0.6,
                                           eos_token_id=[])
    record = {}
    sdar_reference(qwen3, prompt, MASK, 4, 4, 12, "low_confidence_dynamic", 0.6, record=record)
    out = qwen3.generate_multi_block(prompt[None], cfg, return_dict=True)
    assert out.commit_step[0].tolist() == [record[i][0] for i in range(12)]
    torch.testing.assert_close(out.logprobs[0].exp(), torch.tensor([record[i][1] for i in range(12)]))
    torch.testing.assert_close(out.entropies[0], torch.tensor([record[i][2] for i in range(12)]), rtol=1e-4, atol=1e-5)
    blocks = 19 // 4 - 7 // 4 + 1  # decode blocks of prompt 7 + 12 tokens; each gets a store forward (sdar)
    assert int(out.steps[0]) == out.num_forwards - 1 - blocks  # minus the prefill and the store forwards
    assert (out.logprobs <= 0).all() and out.tokens_per_forward == pytest.approx((blocks * 4 - 3) / int(out.steps[0]))


def test_rl_outputs_after_a_stop(qwen3):
    prompts = random_prompts((7, 4), 9)
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=12, attention="block_causal",
                               threshold=0.6, eos_token_id=[])
    free, _ = generate(qwen3, prompts, cfg)
    stop = int(free[0, 2])
    seq, out = generate(qwen3, prompts, cfg.replace(eos_token_id=stop, pad_token_id=0))
    first = seq[0].tolist().index(stop)
    assert (out.commit_step[0, first + 1:] == -1).all() and (out.logprobs[0, first + 1:] == 0).all()
    assert (out.commit_step[0, : first + 1] >= 1).all()
    assert out.commit_step.max() <= out.num_forwards


@pytest.mark.parametrize("strategy,threshold,per_block", [("low_confidence_dynamic", 0.0, 1), ("dynamic_pmax", 1.0, 4)])
def test_forward_counts_set_by_the_strategy(qwen3, strategy, threshold, per_block):
    """τ = 0 commits a whole block per forward; dynamic_pmax at τ = 1 one token per forward."""
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=12, attention="block_causal",
                               strategy=strategy, threshold=threshold, eos_token_id=[])
    _, out = generate(qwen3, [random_prompts((8,), 1)[0]], cfg)
    assert out.num_forwards == 1 + 3 * per_block  # prefill + 3 blocks


def test_preset_errors(qwen3):
    with pytest.raises(ValueError, match="Unknown preset 'jet'.*sdar, llada, dream, fast_dllm, fast_dllm_v2, d3llm"):
        BlockDiffusionConfig.from_preset("jet")
    with pytest.raises(ValueError, match="threshold=2.0"):
        BlockDiffusionConfig.from_preset("sdar", threshold=2.0)
    with pytest.raises(ValueError, match="forced_token_scope='all_active' is invalid: strategy 'sequential'"):
        BlockDiffusionConfig.from_preset("d3llm_llada", strategy="sequential")
    prompt = torch.randint(0, 50, (1, 6))
    for fields, name in ((dict(prompt_attention="block_causal", alignment="prompt_end"), "prompt_attention"),
                         (dict(prompt_attention="bidirectional", prefix_cache_tokens=64), "prefix_cache_tokens")):
        with pytest.raises(ValueError, match=f"BlockDiffusionConfig.{name}=.* is invalid"):
            qwen3.generate_multi_block(prompt, BlockDiffusionConfig(mask_token_id=MASK, block_size=4,
                                                                    attention="block_causal", **fields))
    with pytest.raises(ValueError, match="prompt_attention='causal' is invalid: choose one of block_causal"):
        BlockDiffusionConfig(prompt_attention="causal")
    with attention_profile(qwen3, "bidirectional"):
        cfg = BlockDiffusionConfig.from_preset("sdar", mask_token_id=MASK, block_size=4)
        with pytest.raises(ValueError, match="Preset 'sdar' decodes with attention='block_causal' but this model's "
                                             "profile has attention='bidirectional'"):
            qwen3.generate_multi_block(torch.randint(0, 50, (1, 6)), cfg)
