"""PEFT LoRA pre-merge: full-speed generation with the adapters merged, base weights restored bit-exactly."""

import copy

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig

from helpers import MASK, left_pad, random_prompts, tiny_model

peft = pytest.importorskip("peft")

CFG = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=12, attention="block_causal",
                           threshold=0.6, eos_token_id=[])
TARGETS = ["q_proj", "v_proj", "down_proj"]


def lora(model, name="default", seed=1, targets=TARGETS):
    """Add a LoRA adapter with non-zero B (so it changes the outputs) to a PeftModel or plain model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    if isinstance(model, peft.PeftModel):
        model.add_adapter(name, config)
        return model
    return peft.get_peft_model(model, config, adapter_name=name)


def bits(model):
    return {k: v.detach().clone().view(torch.uint8) for k, v in model.state_dict().items()}


def same_bits(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_same_bits(model, before):
    assert same_bits(bits(model), before)
    assert not any(layer.merged_adapters for layer in model.modules() if hasattr(layer, "merged_adapters"))


@pytest.fixture(scope="module")
def batch():
    return left_pad(random_prompts([5, 9, 3], seed=4))


def test_bf16_weights_restored_bit_exactly(batch):
    model = lora(tiny_model("qwen3", seed=2).to(torch.bfloat16))
    ids, mask = batch
    before = bits(model)
    unmerged = copy.deepcopy(model)
    unmerged.merge_adapter()
    unmerged.unmerge_adapter()
    assert not same_bits(bits(unmerged), before)  # what a merge/unmerge round trip would have left behind
    model.generate_multi_block(ids, CFG, attention_mask=mask)
    assert_same_bits(model, before)


class _FailingStreamer:
    def __init__(self):
        self.calls = 0

    def put(self, tokens):
        self.calls += 1
        if self.calls == 2:  # the prompt goes through, the first generated tokens raise
            raise RuntimeError("streamer broke")

    def end(self):  # a streamer needs both methods (generate_multi_block checks before any forward)
        pass

    def end(self):
        pass


def test_weights_restored_after_an_exception(batch):
    model = lora(tiny_model("qwen3", seed=2).to(torch.bfloat16))
    before = bits(model)
    ids, mask = batch
    with pytest.raises(RuntimeError, match="streamer broke"):
        model.generate_multi_block(ids[:1], CFG, attention_mask=mask[:1], streamer=_FailingStreamer())
    assert_same_bits(model, before)


def test_pre_merged_tokens_equal_merge_and_unload(batch):
    model = lora(tiny_model("qwen3", seed=2))
    ids, mask = batch
    merged_during = []
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    layer.register_forward_pre_hook(lambda module, args: merged_during.append(module.merged))
    out = model.generate_multi_block(ids, CFG, attention_mask=mask)
    assert merged_during and all(merged_during) and not layer.merged
    reference = copy.deepcopy(model).merge_and_unload()
    assert torch.equal(out, reference.generate_multi_block(ids, CFG, attention_mask=mask))
    with model.disable_adapter():  # disabled adapters: the base model's tokens, which the adapter changes
        base = model.generate_multi_block(ids, CFG, attention_mask=mask)
    assert torch.equal(base, tiny_model("qwen3", seed=2).generate_multi_block(ids, CFG, attention_mask=mask))
    assert not torch.equal(out, base)


def test_two_adapters_in_one_call_equal_two_calls(batch):
    model = lora(lora(tiny_model("qwen3", seed=2), "math", seed=1), "code", seed=2, targets=["k_proj", "up_proj"])
    ids, mask = batch
    both = model.generate_multi_block(ids, CFG, attention_mask=mask, adapters=["math", "code"])
    separate = []
    for name in ("math", "code"):
        model.set_adapter(name)
        separate.append(model.generate_multi_block(ids, CFG, attention_mask=mask))
    assert len(both) == 2 and all(torch.equal(x, y) for x, y in zip(both, separate))
    assert not torch.equal(separate[0], separate[1])


def test_missing_adapter_fails_before_any_forward(batch):
    model = lora(lora(tiny_model("qwen3", seed=2), "math"), "code")
    forwards = []
    model.get_base_model().model.register_forward_pre_hook(lambda *args: forwards.append(1))
    ids, mask = batch
    with pytest.raises(ValueError, match="no adapter named chat; available: code, math"):
        model.generate_multi_block(ids, CFG, attention_mask=mask, adapters=["math", "chat"])
    with pytest.raises(ValueError, match="carrying PEFT adapters"):
        tiny_model("qwen3").generate_multi_block(ids, CFG, attention_mask=mask, adapters=["math"])
    assert not forwards


def test_saved_adapter_loads_both_ways(tmp_path, batch):
    ids, mask = batch
    trained = lora(tiny_model("qwen3", seed=2))
    expected = trained.generate_multi_block(ids, CFG, attention_mask=mask)
    trained.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(tiny_model("qwen3", seed=2), tmp_path)
    assert torch.equal(loaded.generate_multi_block(ids, CFG, attention_mask=mask), expected)
    plain = tiny_model("qwen3", seed=2)
    plain.load_adapter(str(tmp_path))
    assert torch.equal(plain.generate_multi_block(ids, CFG, attention_mask=mask), expected)
