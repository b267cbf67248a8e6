"""The released call forms one by one: explicit masks in their dtypes and shapes, the cache keywords of each family,
the cache tuples, and the clear errors for what is not supported."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from released_checkpoints import dream_config, fast_dllm_config, llada_config, sdar_config
from script_harness import load_family
from torch_reference import block_causal, qwen_logits
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_blockdiff.model_patches.released.caches import FlatReleasedCache, ReleasedCache

CONFIGS = {"sdar": sdar_config, "dream": dream_config, "llada": llada_config,
           "fast_dllm": lambda: fast_dllm_config(mask_token_id=95)}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    loaded = {}

    def get(name):
        if name not in loaded:
            config = CONFIGS[name]()
            loaded[name] = (*load_family(tmp_path_factory.mktemp(name), config), config)
        return loaded[name]

    return get


def _ids(length=8, batch=2):
    return torch.randint(0, 90, (batch, length), generator=torch.Generator().manual_seed(3))


def _pattern(length):
    """An arbitrary allowed pattern (not the family's): random keys, the diagonal always allowed."""
    allowed = torch.rand(length, length, generator=torch.Generator().manual_seed(4)) < 0.5
    return allowed | torch.eye(length, dtype=torch.bool)


@pytest.mark.parametrize("form", ["float_3d", "bool_4d", "int_3d"])
@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_explicit_mask_replaces_the_pattern(family, form, implementation):
    model, state, config = family("sdar")
    model.set_attn_implementation(implementation)
    ids, allowed = _ids(), _pattern(8)
    mask = {"float_3d": allowed.float()[None], "bool_4d": allowed[None, None].expand(2, 1, 8, 8),
            "int_3d": allowed.long()[None].expand(2, 8, 8)}[form]
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(logits, qwen_logits(state, config, ids, allowed[None]), atol=1e-5, rtol=1e-5)


def test_additive_4d_mask_is_applied_as_transformers_does(family):
    model, state, config = family("dream")
    ids, allowed = _ids(), _pattern(8)
    additive = torch.zeros(2, 1, 8, 8).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits, all_zero = model(ids, attention_mask=additive).logits, model(ids, torch.zeros(2, 1, 8, 8)).logits
    torch.testing.assert_close(logits, qwen_logits(state, config, ids, allowed[None]), atol=1e-5, rtol=1e-5)
    everything = torch.ones(1, 8, 8, dtype=torch.bool)
    torch.testing.assert_close(all_zero, qwen_logits(state, config, ids, everything), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask, message", [
    (torch.zeros(1, 8, 8).masked_fill(~_pattern(8), -1e9), "read as 0/1"),
    (torch.ones(2, 4, 8, 8, dtype=torch.bool), "Per-head"),
    (torch.ones(1, 8, 9), "covers 9 keys"),
    (torch.ones(3, 8, 8), "does not fit"),
])
def test_unsupported_explicit_masks_are_refused(family, mask, message):
    model = family("sdar")[0]
    with pytest.raises(ValueError, match=message):
        model(_ids(), attention_mask=mask)


def test_explicit_mask_needs_an_attention_with_a_mask_function(family):
    model = family("sdar")[0]
    AttentionInterface.register("no_mask_function", sdpa_attention_forward)
    model.set_attn_implementation("no_mask_function")
    try:
        with pytest.raises(ValueError, match="cannot be applied"):
            model(_ids(), attention_mask=torch.ones(1, 8, 8))
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("store_kv, stored", [(False, 4), (True, 8), (None, 8)])
def test_sdar_store_kv(family, store_kv, stored):
    model, state, config = family("sdar")
    ids, cache = _ids(), DynamicCache()
    keywords = {} if store_kv is None else {"store_kv": store_kv}
    with torch.no_grad():
        model(ids[:, :4], past_key_values=cache, use_cache=True)
        logits = model(ids[:, 4:], past_key_values=cache, use_cache=True, **keywords).logits
    assert cache.get_seq_length() == stored
    expected = qwen_logits(state, config, ids, block_causal(8, 4)[None])[:, 4:]
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)


def test_dream_full_mask(family):
    model = family("dream")[0]
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, "full").logits, model(ids).logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="'full'"):
        model(ids, "causal")
    with pytest.raises(ValueError, match="dual_cache=True together with replace_position"):
        model(ids, "full", dual_cache=True, use_cache=True)


@pytest.mark.parametrize("name", ["llada", "dream"])
@pytest.mark.parametrize("marked, message", [((2, 4), "contiguous"), ((2, 7), "contiguous"), (None, "needs")])
def test_bad_replace_position_is_refused(family, name, marked, message):
    model, ids = family(name)[0], _ids(batch=1)
    extra = {"dual_cache": True} if name == "dream" else {}
    replace_position = torch.zeros(1, 8, dtype=torch.bool)
    cache = None
    if marked is not None:
        replace_position[0, list(marked)] = True
        cache = model(ids, use_cache=True).past_key_values
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        model(ids[:, 2:4], past_key_values=cache, replace_position=replace_position, **extra)


def test_llada_attention_bias_is_refused(family):
    with pytest.raises(ValueError, match="attention_bias"):
        family("llada")[0](_ids(), attention_bias=torch.zeros(1, 1, 8, 8))


def test_fast_dllm_v2_refusals_and_block_cache_output(family):
    model = family("fast_dllm")[0]
    ids = _ids()
    with pytest.raises(ValueError, match="bd_size=4"):
        model(ids, block_size=32)
    with pytest.raises(ValueError, match="needs use_block_cache"):
        model(ids, use_cache=True, replace_position=0)
    with torch.no_grad():
        output = model(ids[:, 4:], use_cache=True, update_past_key_values=False, use_block_cache=True)
        decoder_output = model.model(ids[:, 4:], use_cache=True, use_block_cache=True)
    assert output.past_key_values.get_seq_length() == 0 and output.block_past_key_values.get_seq_length() == 4
    assert decoder_output.past_key_values.get_seq_length() == 4
    assert decoder_output.block_past_key_values.get_seq_length() == 4


def test_released_cache_reads_and_drops_rows_like_the_released_tuples(family):
    model, _, config = family("fast_dllm")
    with torch.no_grad():
        cache = model(_ids(batch=3), use_cache=True).past_key_values
    assert isinstance(cache, ReleasedCache) and len(cache) == 2 and len(cache[1]) == 2
    kept = torch.tensor([True, False, True])
    expected = [layer.keys[kept] for layer in cache.layers]
    for layer in range(len(cache)):  # Fast-dLLM v2's batch_sample drops finished rows this way
        cache.key_cache[layer] = cache.key_cache[layer][kept]
        cache.value_cache[layer] = cache.value_cache[layer][kept]
    assert all(torch.equal(cache[i][0], expected[i]) for i in range(2)) and cache.key_cache[0].shape[0] == 2
    with pytest.raises(ValueError, match="3 layers"):
        ReleasedCache.from_released([cache[0]] * 3, model.config)


def test_dream_cache_tuples_are_batch_length_width(family):
    model = family("dream")[0]
    with torch.no_grad():
        cache = model(_ids(), use_cache=True).past_key_values
    keys, values = cache[0]
    assert isinstance(cache, FlatReleasedCache) and keys.shape == (2, 8, 2 * 8)
    again = FlatReleasedCache.from_released([cache[i] for i in range(len(cache))], model.config)
    assert torch.equal(again.layers[0].keys, cache.layers[0].keys)
    with pytest.raises(ValueError, match=r"\[batch, length, width\]"):
        FlatReleasedCache.from_released([(layer.keys, layer.values) for layer in cache.layers], model.config)



@pytest.mark.parametrize("name", ["sdar", "dream", "fast_dllm"])
def test_decoder_returns_tuples_on_request(family, name):
    decoder = family(name)[0].model
    ids = _ids()
    with torch.no_grad():
        as_tuple, as_output = decoder(ids, return_dict=False), decoder(ids)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], as_output.last_hidden_state)


def test_fast_dllm_v2_sample_with_top_p(family):
    sample = family("fast_dllm")[0].sample_with_top_p
    logits = torch.randn(2, 5, 96, generator=torch.Generator().manual_seed(5))
    tokens, probs = sample(logits, temperature=0.0)
    assert torch.equal(tokens, logits.argmax(-1)) and torch.equal(probs, logits.softmax(-1))
    tokens, probs = sample(logits, top_p=1e-6, temperature=0.7)  # the nucleus is the most likely token alone
    assert torch.equal(tokens, logits.argmax(-1)) and torch.equal(probs, F.one_hot(tokens, 96).float())
    tokens, probs = sample(logits, top_p=1.0, temperature=0.7)
    torch.testing.assert_close(probs, (logits / 0.7).softmax(-1))
    assert tokens.shape == (2, 5)
    tokens, probs = sample(logits, top_p=0.5, temperature=1.0)
    kept = probs > 0
    assert kept.gather(-1, tokens[..., None]).all() and (probs.sum(-1) - 1).abs().max() < 1e-6
    ordered = logits.softmax(-1).sort(-1, descending=True).values
    expected_size = ((ordered.cumsum(-1) - ordered) <= 0.5).sum(-1)
    assert torch.equal(kept.sum(-1), expected_size)
