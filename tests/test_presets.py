"""Every preset token for token against a plain re-implementation of its reference loop (batch 1 and a padded
batch), RL outputs, forward counts that strategies determine, and preset errors."""

import warnings
from contextlib import contextmanager

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.config.profiles import ModelProfile
from hf_blockdiff.tools.demo import DEMO_SEED, load_demo
from hf_blockdiff.tools.tasks import is_correct, make_problems, solve
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


@pytest.mark.parametrize("minimal_topk", [1, 2, 4])
def test_minimal_topk_caps_the_steps(qwen3, minimal_topk):
    """llada2's minimal_topk k caps S at max_new_tokens // k, as diffusers' LLaDA2Pipeline (S = 4, 3, 1 here): fewer
    steps, each committing more by the schedule (τ = 0.99 leaves most commits to it)."""
    cfg = BlockDiffusionConfig.from_preset("llada2", mask_token_id=MASK, block_size=4, max_new_tokens=6,
                                           threshold=0.99, minimal_topk=minimal_topk, eos_token_id=[])
    prompts = random_prompts(PROMPTS, 8)

    def reference(prompt, k=minimal_topk):
        return sdar_reference(qwen3, prompt, MASK, 4, 4, 6, "low_confidence_dynamic", 0.99, minimal_topk=k)

    check(qwen3, prompts, cfg, reference, forwards=False)
    if minimal_topk > 1:  # the cap changes the tokens, so the comparison above sees it
        assert any(reference(p)[0].tolist() != reference(p, 1)[0].tolist() for p in prompts)
        _, out = generate(qwen3, prompts, cfg)
        _, uncapped = generate(qwen3, prompts, cfg.replace(minimal_topk=None))
        assert out.steps.sum() < uncapped.steps.sum()


def test_minimal_topk_errors():
    for value in (0, 5, True, 2.0):
        with pytest.raises(ValueError, match=rf"minimal_topk={value!r} is invalid: .*≤ max_new_tokens \(4 here\)"):
            BlockDiffusionConfig(block_size=4, max_new_tokens=4, minimal_topk=value)
    with pytest.raises(ValueError, match=r"minimal_topk=4 is invalid: .*\(3 here\)"):
        BlockDiffusionConfig.from_preset("llada2", max_new_tokens=3, minimal_topk=4)
    assert BlockDiffusionConfig.from_preset("llada2").minimal_topk == 1 and BlockDiffusionConfig().minimal_topk is None


def test_minimal_topk_above_the_block_size_is_diffusers_cap():
    """diffusers bounds k by the generation's length only: k = 8 over 16 new tokens in blocks of 4 leaves 2 steps."""
    profile = ModelProfile(mask_token_id=MASK, attention="block_causal", logit_shift=False)
    cfg = BlockDiffusionConfig.from_preset("llada2", block_size=4, max_new_tokens=16, minimal_topk=8)
    assert cfg.resolved(profile).steps_per_block == 2


def test_preset_block_size_yields_to_the_trained_one():
    """A block-causal checkpoint's block size beats the preset's, and S follows it; a bidirectional profile's block
    size is a decoding default, and the preset's beats it (dLLM-Var decodes a LLaDA checkpoint in blocks of 64)."""
    trained = ModelProfile(mask_token_id=1, block_size=4, attention="block_causal", alignment="absolute",
                           logit_shift=False)
    llada = ModelProfile(mask_token_id=1, block_size=32, attention="bidirectional", alignment="prompt_end",
                         logit_shift=False)
    for name in ("llada2", "llada2_1", "diffulex_edit", "dllm_var"):
        resolved = BlockDiffusionConfig.from_preset(name, max_new_tokens=64).resolved(trained)
        assert (resolved.block_size, resolved.steps_per_block) == (4, 4)
    assert BlockDiffusionConfig.from_preset("llada2", max_new_tokens=64).resolved(
        ModelProfile(mask_token_id=1)).steps_per_block == 32
    assert BlockDiffusionConfig.from_preset("dllm_var").resolved(llada).block_size == 64
    assert BlockDiffusionConfig().resolved(llada).block_size == 32
    untrained = ModelProfile(mask_token_id=1, attention="block_causal")
    assert BlockDiffusionConfig.from_preset("llada2", max_new_tokens=20).resolved(untrained).steps_per_block == 20


@pytest.fixture(scope="module")
def demo():
    """The bundled demo model (an SDAR checkpoint trained with blocks of 4) and held-out additions and such."""
    model, tokenizer = load_demo(None)
    return model, tokenizer, make_problems(24, DEMO_SEED, "held_out")


@pytest.mark.parametrize("name", ["llada2", "dllm_var", "sdar"])
def test_presets_decode_at_the_trained_block_size(demo, name):
    """Presets with blocks of 32 or 64 decode the demo model at its trained size 4, silently, and solve its problems
    (at 32 llada2 got none right)."""
    model, tokenizer, problems = demo
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert solve(model, tokenizer, problems, BlockDiffusionConfig.from_preset(name, max_new_tokens=8)).accuracy \
            >= 0.95


@pytest.mark.parametrize("name", ["llada2_1", "diffulex_edit"])
def test_editing_presets_decode_at_the_trained_block_size(demo, name):
    """The editing presets (rows of pad ids at blocks of 32) decode the demo model at its size 4: the same tokens
    as with block_size=4 passed, and every row that took no edit solves its problem. (Edits make other answers
    wrong: the demo model was trained on masked positions only, so its proposals at decided positions are
    untrained.)"""
    model, tokenizer, problems = demo
    enc = tokenizer([p for p, _ in problems], return_tensors="pt", padding=True, add_special_tokens=False)
    cfg = BlockDiffusionConfig.from_preset(name, max_new_tokens=8)
    out = model.generate_multi_block(enc.input_ids, cfg, attention_mask=enc.attention_mask, return_dict=True)
    explicit = model.generate_multi_block(enc.input_ids, cfg.replace(block_size=4), attention_mask=enc.attention_mask)
    assert torch.equal(out.sequences, explicit)
    texts = tokenizer.batch_decode(out.sequences[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    unedited = [is_correct(prompt, text) for (prompt, _), text, edits in zip(problems, texts, out.edits) if edits == 0]
    assert len(unedited) >= len(problems) // 6 and all(unedited)


def test_explicit_block_size_wins_and_warns_once(demo):
    model, tokenizer, problems = demo
    for cfg in (BlockDiffusionConfig(max_new_tokens=8, block_size=16),
                BlockDiffusionConfig.from_preset("llada2", max_new_tokens=8, block_size=16)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            solved = solve(model, tokenizer, problems, cfg)
        messages = [str(w.message) for w in caught if "block_size" in str(w.message)]
        assert len(messages) == 1 and "block_size=16 differs from block_size=4" in messages[0]
        assert solved.accuracy < 0.5  # decoded at 16, as asked: this model was not trained so


def test_fast_dllm_v2_lists_every_conflict(demo):
    """fast_dllm_v2 on the demo model (no logit shift, blocks of 4): one error names both conflicts and the overrides
    that lift them, and those overrides decode."""
    model, tokenizer, problems = demo
    cfg = BlockDiffusionConfig.from_preset("fast_dllm_v2", max_new_tokens=8)
    with pytest.raises(ValueError) as error:
        solve(model, tokenizer, problems, cfg)
    message = str(error.value)
    assert "logit_shift=True but this model's profile has logit_shift=False" in message
    assert "sub_block_size=8 but this model's block_size=4 is not a multiple of it" in message
    fix = "from_preset('fast_dllm_v2', logit_shift=False, first_token_on_store=False, sub_block_size=4)"
    assert message.endswith(f"override them: {fix}.")
    fixed = BlockDiffusionConfig.from_preset("fast_dllm_v2", max_new_tokens=8, logit_shift=False,
                                             first_token_on_store=False, sub_block_size=4)
    assert solve(model, tokenizer, problems, fixed).accuracy >= 0.95
