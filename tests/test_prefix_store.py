"""`prefix_cache_tokens`: prompt prefixes kept across calls are reused by later prompts that start with the same
tokens (same tokens as decoding without the store, less prefill), evicted least recently used, and never served
after the weights change."""

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.generation.executor import ModelExecutor
from helpers import MASK, left_pad, random_prompts, tiny_model

BASE = dict(mask_token_id=MASK, block_size=4, max_new_tokens=8, attention="block_causal", eos_token_id=[],
            threshold=0.6, page_size=8)  # a unit of reuse is lcm(8, 4) = 8 tokens
STORE = BlockDiffusionConfig(**BASE, prefix_cache_tokens=64)
PLAIN = BlockDiffusionConfig(**BASE)
FIRST = random_prompts((37,), seed=11)[0]  # prefix 36: units [0, 8) ... [0, 32) are stored
SECOND = torch.cat([FIRST[:33], random_prompts((8,), seed=12)[0]])  # prefix 40: its first 32 tokens are FIRST's


def decode(model, cfg, prompts, **kwargs):
    """Generated tokens, and the number of positions the call's first forward (the prefill) computed."""
    seen, forward = [], ModelExecutor.forward

    def counting(self, layout):
        seen.append(int(layout.chunks.valid.sum()))
        return forward(self, layout)

    ModelExecutor.forward = counting
    try:
        ids, mask = left_pad(prompts)
        out = model.generate_multi_block(ids, cfg, attention_mask=mask, **kwargs)
    finally:
        ModelExecutor.forward = forward
    return out[:, ids.shape[1]:], seen[0]


def test_a_later_prompt_reads_the_stored_prefix():
    model = tiny_model("qwen3")
    plain, plain_prefill = decode(model, PLAIN, [SECOND])
    decode(model, STORE, [FIRST])
    reused, reused_prefill = decode(model, STORE, [SECOND])
    assert torch.equal(reused, plain)
    assert plain_prefill - reused_prefill == 32  # the first 4 units came from the store


def test_eviction_takes_the_ends_of_chains_first():
    """A store of 2 units keeps a prompt's first two units (its chain's start), so the next prompt still reuses
    16 tokens; the least recently used chain goes when another prompt's units arrive."""
    model = tiny_model("qwen3")
    small = BlockDiffusionConfig(**BASE, prefix_cache_tokens=16)
    other = random_prompts((25,), seed=13)[0]
    decode(model, small, [FIRST])
    _, prefill = decode(model, small, [SECOND])
    assert prefill == 40 - 16
    store = model._blockdiff_engine.pages.store
    assert len(store.units) == 2
    decode(model, small, [other])  # its 3 units replace the 2 kept: the store still holds 2, both of `other`
    assert len(store.units) == 2 and all(key.startswith(other[:8].numpy().tobytes()) for key in store.units)


def _load_perturbed(model):
    state = {name: tensor + 0.05 * torch.randn_like(tensor) for name, tensor in model.state_dict().items()}
    model.load_state_dict(state)


def _optimizer_step(model):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.tensor([[1, 2, 3, 4]])).logits.square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _through_data(model):
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.data.mul_(-1.0)


@pytest.mark.parametrize("change", [_load_perturbed, _optimizer_step, _through_data])
def test_a_weight_change_empties_the_store(change, monkeypatch):
    model = tiny_model("qwen3")
    decode(model, STORE, [FIRST])
    change(model)
    expected, _ = decode(model, PLAIN, [SECOND])
    got, prefill = decode(model, STORE, [SECOND])
    assert torch.equal(got, expected) and prefill == 40
    # the check matters: with the fingerprint blind to the change, the stale prefix is read and the tokens differ
    model = tiny_model("qwen3")
    monkeypatch.setattr("hf_blockdiff.generation.engine.weights_fingerprint", lambda model: "blind")
    decode(model, STORE, [FIRST])
    change(model)
    stale, prefill = decode(model, STORE, [SECOND])
    assert prefill == 8 and not torch.equal(stale, expected)


def test_samples_and_store_together():
    """num_return_sequences on top of a stored prefix: equal to the repeated prompts decoded without either."""
    model = tiny_model("qwen3")
    sampled = dict(BASE, temperature=1.0, top_k=20)
    decode(model, BlockDiffusionConfig(**sampled, prefix_cache_tokens=64), [FIRST])
    got, _ = decode(model, BlockDiffusionConfig(**sampled, prefix_cache_tokens=64), [SECOND, FIRST],
                    num_return_sequences=3, generator=torch.Generator().manual_seed(3))
    expected, _ = decode(model, BlockDiffusionConfig(**sampled), [SECOND] * 3 + [FIRST] * 3,
                         generator=torch.Generator().manual_seed(3))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("settings, message", [
    (dict(prefix_cache_tokens=-8), "number of tokens"),
    (dict(prefix_cache_tokens=2.5), "number of tokens"),
    (dict(prefix_cache_tokens=4), "no unit of reuse"),
    (dict(prefix_cache_tokens=64, attention="bidirectional", alignment="prompt_end"), "block-causal"),
    (dict(prefix_cache_tokens=64, alignment="prompt_end"), "absolute blocks"),
])
def test_bad_prefix_cache_tokens(settings, message):
    model = tiny_model("qwen3")
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        try:
            model.generate_multi_block(torch.tensor([[5, 6, 7]]), BlockDiffusionConfig(**{**BASE, **settings}))
        except ValueError as error:
            assert message in str(error)
            raise


def test_a_lora_merged_for_the_call_is_a_weight_change(monkeypatch):
    """An adapter merged for a call (PEFT) changes the weights: prefixes stored from the base model are not read."""
    peft = pytest.importorskip("peft")

    def with_lora(model):
        torch.manual_seed(1)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"], init_lora_weights=False)
        return peft.get_peft_model(model, config)

    expected, _ = decode(with_lora(tiny_model("qwen3")), PLAIN, [SECOND])
    for blind in (False, True):
        if blind:  # the control: a fingerprint blind to the merge reads the base model's prefix, and tokens differ
            monkeypatch.setattr("hf_blockdiff.generation.engine.weights_fingerprint", lambda model: "blind")
        base = tiny_model("qwen3")
        decode(base, STORE, [FIRST])
        got, prefill = decode(with_lora(base), STORE, [SECOND])
        assert (prefill, torch.equal(got, expected)) == ((8, False) if blind else (40, True))


def test_a_store_that_leaves_no_room_for_a_prompt_is_refused():
    model = tiny_model("qwen3")
    cfg = BlockDiffusionConfig(**BASE, prefix_cache_tokens=64, max_cache_tokens=96)  # a canvas of 48 + 64 > 96
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        model.generate_multi_block(torch.tensor([[5] * 37]), cfg)
    assert getattr(model, "_blockdiff_engine", None) is None  # refused before anything was built
