"""Every family: a tiny checkpoint in the released format loads through the Auto classes without remote code, its
logits equal an independent plain-torch forward (fp32), the decode loop's hooks (attention interface, cache, extra
kwargs) are honoured, and `save_pretrained` writes the released format back."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from released_checkpoints import (dream_config, fast_dllm_config, llada2_config, llada_config, random_state,
                                  sdar_config, sdar_moe_config, write_checkpoint)
from safetensors import safe_open
from torch_reference import block_causal, key_padding, llada2_logits, llada_logits, qwen_logits
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_blockdiff.cache.keyword import CACHE_KEYWORD, cache_kwarg
from hf_blockdiff.model_patches import profile_for

# family -> (released config, reference forward, attention rule)
FAMILIES = {
    "sdar": (sdar_config, qwen_logits, "block_causal"),
    "sdar_moe": (sdar_moe_config, qwen_logits, "block_causal"),
    "llada": (llada_config, llada_logits, "bidirectional"),
    "dream": (dream_config, qwen_logits, "bidirectional"),
    "fast_dllm": (fast_dllm_config, qwen_logits, "block_causal"),
    "llada2": (llada2_config, llada2_logits, "block_causal"),
}
BLOCK_CAUSAL = [name for name, (_, _, rule) in FAMILIES.items() if rule == "block_causal"]
FAMILY_PARAMS = list(FAMILIES)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (directory, released config, released weights, loaded model), written and loaded once."""
    cache = {}

    def get(name):
        if name not in cache:
            config = FAMILIES[name][0]()
            state = random_state(config)
            directory = write_checkpoint(tmp_path_factory.mktemp(name), config, state)
            model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
            cache[name] = directory, config, state, model
        return cache[name]

    return get


def _pattern(name, config, length):
    if FAMILIES[name][2] == "bidirectional":
        return torch.ones(length, length, dtype=torch.bool)
    return block_causal(length, config.get("block_size", config.get("bd_size")))


def _ids(length=11, batch=2, seed=1):
    return torch.randint(0, 90, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_loads_with_our_classes_and_profile(name, checkpoints):
    _, config, _, model = checkpoints(name)
    assert type(model).__name__ == config["architectures"][0]
    assert type(model).__module__.startswith("hf_blockdiff.model_patches.")
    assert model.config._attn_implementation == "sdpa"  # SDAR's released "flex_attention" is not forced
    profile = profile_for(model.config)
    assert profile.attention == FAMILIES[name][2]
    assert profile.mask_token_id == config.get("mask_token_id", {"llada2": 156895}.get(name, 151665))
    assert profile.block_size == config.get("block_size", config.get("bd_size", 32 if name == "llada" else None))


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_logits_match_plain_torch_reference(name, checkpoints):
    _, config, state, model = checkpoints(name)
    ids = _ids()
    # fp32 noise: LLaDA2's routed_scaling_factor (2.5) amplifies summation-order differences to ~1e-5
    reference = FAMILIES[name][1](state, config, ids, _pattern(name, config, ids.shape[1])[None])
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits, reference, atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_padding_mask_removes_padded_keys(name, checkpoints):
    _, config, state, model = checkpoints(name)
    ids = _ids(length=9)
    attention_mask = torch.ones_like(ids)
    attention_mask[1, 6:] = 0  # right padding keeps absolute positions and blocks unchanged
    allowed = _pattern(name, config, ids.shape[1])[None] & key_padding(attention_mask)
    reference = FAMILIES[name][1](state, config, ids, allowed)
    with torch.no_grad():
        logits = model(ids, attention_mask=attention_mask).logits
    kept = attention_mask.bool()
    torch.testing.assert_close(logits[kept], reference[kept], atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BLOCK_CAUSAL)
def test_block_causal_window_over_cached_prefix(name, checkpoints):
    """Block-causal attention makes a prefix cache exact: prefill 2 blocks, then one window of 2 blocks."""
    _, config, _, model = checkpoints(name)
    ids = _ids(length=16)
    cache = DynamicCache()
    with torch.no_grad():
        full = model(ids).logits
        model(ids[:, :8], past_key_values=cache, use_cache=True)
        window = model(ids[:, 8:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(window, full[:, 8:], atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_forwards_pass_the_installed_cache_keyword(name, checkpoints):
    """transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40): a forward
    given the cache under the installed version's keyword, and one given none, pass it on under that keyword, so
    nothing warns, and return the caller's cache under it."""
    _, _, _, model = checkpoints(name)
    cache = DynamicCache()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values", category=FutureWarning)
        with torch.no_grad():
            model(_ids(length=8))
            output = model(_ids(length=8), **cache_kwarg(cache), use_cache=True)
    assert getattr(output, CACHE_KEYWORD) is cache and cache.get_seq_length() == 8


def _probe(calls):
    def probe(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.layer_idx, attention_mask, key.shape[-2], kwargs.get("loop_tag")))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    return probe


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_decode_loop_hooks(name, checkpoints):
    """The loop registers its attention function, passes position_ids, its cache and its own kwargs: the attention
    function must receive the kwargs and no mask it cannot read, and the cache must get every layer's K/V."""
    directory, config, _, _ = checkpoints(name)
    calls = []
    AttentionInterface.register("model_patches_probe", _probe(calls))
    model = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="model_patches_probe"
    )
    ids, cache = _ids(length=8), DynamicCache()
    with torch.no_grad():
        model(ids, position_ids=torch.arange(8)[None].expand(2, -1), past_key_values=cache, use_cache=True,
              loop_tag="from-the-loop")
    layers = config.get("num_hidden_layers", config.get("n_layers"))
    assert [call[0] for call in calls] == list(range(layers))
    assert all(mask is None and keys == 8 and tag == "from-the-loop" for _, mask, keys, tag in calls)
    assert cache.get_seq_length() == 8


@pytest.mark.parametrize("name", FAMILY_PARAMS)
def test_save_pretrained_writes_released_format(name, checkpoints, tmp_path):
    directory, config, state, model = checkpoints(name)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert {key: saved.get(key) for key in config if key != "transformers_version"} == {
        key: value for key, value in config.items() if key != "transformers_version"
    }
    with safe_open(tmp_path / "model.safetensors", "pt") as saved_weights:
        assert sorted(saved_weights.keys()) == sorted(state)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=0, rtol=0)


def test_tied_head_is_not_a_missing_weight(tmp_path):
    """Fast-dLLM v2 1.5B ties its head to the input embedding: no `lm_head.weight` on disk, none missing."""
    config = fast_dllm_config(tie_word_embeddings=True)
    state = random_state(config)
    model = AutoModelForCausalLM.from_pretrained(write_checkpoint(tmp_path, config, state), dtype=torch.float32)
    ids = _ids()
    with torch.no_grad():
        logits = model(ids).logits
    torch.testing.assert_close(logits, qwen_logits(state, config, ids, block_causal(11, 4)[None]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", FAMILY_PARAMS)
@pytest.mark.parametrize("damage", ["missing", "shape"])
def test_checkpoint_not_matching_its_config_raises(name, damage, checkpoints, tmp_path):
    _, config, state, _ = checkpoints(name)
    state = dict(state)
    victim = sorted(k for k in state if k.endswith("weight") and state[k].ndim == 2 and ".1." in k)[0]
    if damage == "missing":
        del state[victim]
    else:
        state[victim] = torch.zeros(state[victim].shape[0], state[victim].shape[1] + 1)
    write_checkpoint(tmp_path, config, state)
    with pytest.raises((ValueError, RuntimeError)):
        AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
