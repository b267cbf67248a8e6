"""`BlockDiffusionConfig.runtime`: the options of how a call runs, one nested object whose fields are keywords of the
config, its `replace` and `from_preset`, and the call (docs/architecture.md, "Calling conventions")."""

import dataclasses

import pytest

from hf_blockdiff import BlockDiffusionConfig, RuntimeOptions
from hf_blockdiff.config.runtime import RUNTIME_FIELDS

from helpers import MASK, left_pad, random_prompts, tiny_model


def test_keywords_set_the_runtime_fields():
    cfg = BlockDiffusionConfig(block_size=4, compile=False, page_size=32, max_batch_size=3)
    assert cfg.runtime == RuntimeOptions(compile=False, page_size=32, max_batch_size=3)
    assert cfg.explicit_fields == {"block_size", "runtime"}
    assert cfg.replace(attention_backend="sdpa").runtime == RuntimeOptions(
        attention_backend="sdpa", compile=False, page_size=32, max_batch_size=3)
    assert BlockDiffusionConfig.from_preset("sdar", cuda_graphs=False).runtime == RuntimeOptions(cuda_graphs=False)
    given = RuntimeOptions(page_size=16, compile=True)  # a keyword wins over the object passed beside it
    assert BlockDiffusionConfig(runtime=given, compile=False).runtime == RuntimeOptions(page_size=16, compile=False)
    assert BlockDiffusionConfig().to_dict()["runtime"]["page_size"] == 64


@pytest.mark.parametrize("name", RUNTIME_FIELDS)
def test_the_old_attribute_names_the_new_place(name):
    cfg = BlockDiffusionConfig()
    with pytest.raises(AttributeError, match=f"config.runtime.{name}"):
        getattr(cfg, name)
    with pytest.raises(AttributeError, match=f"config.runtime.{name}"):
        setattr(cfg, name, None)


@pytest.mark.parametrize("fields, match", [
    (dict(page_size=48), r"runtime.page_size=48 is invalid: pass a power of two"),
    (dict(max_batch_size=0), r"runtime.max_batch_size=0 is invalid: pass a positive integer"),
    (dict(attention_backend="flex"), r"runtime.attention_backend='flex' is invalid: choose one of"),
    (dict(compile="yes"), r"runtime.compile='yes' is invalid: pass True, False or None"),
    (dict(prefix_cache_tokens=-1), r"runtime.prefix_cache_tokens=-1 is invalid"),
    (dict(runtime={"compile": False}), r"runtime=\{'compile': False\} is invalid: pass a RuntimeOptions"),
])
def test_bad_runtime_options_are_refused_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        BlockDiffusionConfig(**fields)


def test_runtime_options_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        BlockDiffusionConfig().runtime.compile = True


def test_max_batch_size_keyword_is_the_runtime_field_and_keeps_the_engine():
    """`max_batch_size=` of the call sets `runtime.max_batch_size`; calls that differ only there and need as many
    slots reuse the engine, and the tokens do not depend on it (two slots stream the five prompts)."""
    model = tiny_model()
    ids, mask = left_pad(random_prompts((5, 7, 6, 9, 4), seed=3))
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, eos_token_id=[],
                               attention="block_causal")
    full = model.generate_multi_block(ids, cfg, attention_mask=mask, max_batch_size=6)  # 5 prompts: 6 slots
    engine = model._blockdiff_engine
    assert model.generate_multi_block(ids, cfg, attention_mask=mask).tolist() == full.tolist()  # 6 again
    assert model._blockdiff_engine is engine
    assert model.generate_multi_block(ids, cfg, attention_mask=mask, max_batch_size=2).tolist() == full.tolist()
    with pytest.raises(ValueError, match="runtime.max_batch_size=-1"):
        model.generate_multi_block(ids, cfg, attention_mask=mask, max_batch_size=-1)
