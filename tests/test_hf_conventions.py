"""Hugging Face calling conventions (docs/architecture.md): keywords override config fields, return_dict_in_generate,
a GenerationConfig as config, the model's generation_config as the checkpoint's defaults, `generate` and
`pipeline("text-generation")` on a diffusion checkpoint, and the CLI's --preset."""

import copy
import dataclasses
import pickle
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM, AutoTokenizer, GenerationConfig, GenerationMixin, Qwen3ForCausalLM, pipeline,
)
from transformers.utils import logging as transformers_logging

from hf_blockdiff import BlockDiffusionConfig, BlockDiffusionOutput
from hf_blockdiff.assets import demo_model_path
from hf_blockdiff.cli import main
from hf_blockdiff.generation import hf_conventions
from hf_blockdiff.generation.hf_conventions import as_given, merged_config

SDAR_CHAT = Path(__file__).parent / "fixtures" / "reference" / "SDAR-4B-Chat"


@pytest.fixture(scope="module")
def demo():
    model = AutoModelForCausalLM.from_pretrained(demo_model_path()).eval()
    return model, AutoTokenizer.from_pretrained(demo_model_path())


@pytest.fixture
def sdar_chat(demo):
    model, _ = demo
    original = model.generation_config
    model.generation_config = GenerationConfig.from_pretrained(SDAR_CHAT)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 1, 0  # the demo vocabulary's
    yield model
    model.generation_config = original


def prompt_ids(tokenizer, text="37+50="):
    return tokenizer(text, return_tensors="pt").input_ids


def test_keywords_override_config_fields(demo):
    model, tokenizer = demo
    ids = prompt_ids(tokenizer)
    out = model.generate_multi_block(ids, BlockDiffusionConfig(max_new_tokens=16), max_new_tokens=8)
    assert out.shape == (1, ids.shape[1] + 8)


def test_unknown_keyword_names_the_close_fields(demo):
    model, tokenizer = demo
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate_multi_block(prompt_ids(tokenizer), max_new_token=8)


def test_return_dict_in_generate_returns_the_output_object_and_unsupported_outputs_are_refused(demo):
    model, tokenizer = demo
    out = model.generate_multi_block(prompt_ids(tokenizer), max_new_tokens=8, return_dict_in_generate=True)
    assert isinstance(out, BlockDiffusionOutput) and out.num_forwards > 0
    with pytest.raises(ValueError, match="output_scores"):
        model.generate_multi_block(prompt_ids(tokenizer), output_scores=True)


def test_generation_config_as_config(demo):
    model, tokenizer = demo
    ids = prompt_ids(tokenizer)
    out = model.generate_multi_block(ids, GenerationConfig(max_new_tokens=4, do_sample=False))
    assert out.shape == (1, ids.shape[1] + 4)
    assert merged_config(model, GenerationConfig(do_sample=False), {}).temperature == 0
    with pytest.raises(ValueError, match="num_beams"):
        model.generate_multi_block(ids, GenerationConfig(num_beams=2))
    with pytest.raises(ValueError, match=r"do_sample=False and temperature=0.7"):
        model.generate_multi_block(ids, GenerationConfig(do_sample=False, temperature=0.7))


def test_a_keyword_wins_over_the_generation_configs_field(demo):
    model, tokenizer = demo
    sampling = GenerationConfig(do_sample=True, temperature=0.7, max_new_tokens=16)
    cfg = merged_config(model, sampling, {"temperature": 0, "max_new_tokens": 8})
    assert (cfg.temperature, cfg.max_new_tokens) == (0, 8)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, generation_config=GenerationConfig(
        max_new_tokens=16, do_sample=False))
    assert pipe("37+50=", max_new_tokens=8)[0]["generated_text"] == "37+50=87"


def test_do_sample_samples_at_transformers_defaults_for_the_unset_parameters(demo, sdar_chat):
    fields = lambda cfg: (cfg.temperature, cfg.top_k, cfg.top_p)  # noqa: E731
    model, _ = demo
    sample = {"do_sample": True}
    original = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        assert fields(merged_config(model, None, sample)) == (1.0, 50, 1.0)
        assert fields(merged_config(model, GenerationConfig(do_sample=True, top_p=0.9), {})) == (1.0, 50, 0.9)
        assert fields(merged_config(model, BlockDiffusionConfig(temperature=0.5), sample)) == (0.5, 50, 1.0)
        assert fields(merged_config(model, BlockDiffusionConfig(temperature=0.0), sample)) == (1.0, 50, 1.0)
        assert fields(merged_config(model, GenerationConfig(do_sample=True), {"temperature": 0})) == (0, 0, 1.0)
    finally:
        model.generation_config = original
    assert fields(merged_config(sdar_chat, None, {"do_sample": True, "top_k": 4})) == (0.6, 4, 0.95)
    with pytest.raises(ValueError, match="do_sample=True and temperature=0"):
        merged_config(sdar_chat, None, {"do_sample": True, "temperature": 0})


def test_call_arguments_of_a_generation_config_reach_the_call(demo):
    model, tokenizer = demo
    ids = prompt_ids(tokenizer)
    out = model.generate_multi_block(ids, GenerationConfig(do_sample=True, num_return_sequences=2, max_new_tokens=4,
                                                           return_dict_in_generate=True))
    assert isinstance(out, BlockDiffusionOutput) and out.sequences.shape == (2, ids.shape[1] + 4)
    out = model.generate_multi_block(ids, GenerationConfig(do_sample=True, num_return_sequences=2, max_new_tokens=4),
                                     num_return_sequences=3)
    assert out.shape == (3, ids.shape[1] + 4)  # the keyword wins


def test_max_length_is_refused_by_name_and_stop_strings_stop_the_pipeline(demo):
    model, tokenizer = demo
    ids = prompt_ids(tokenizer)
    for config, keywords in ((None, {"max_length": 20}), (GenerationConfig(max_length=20), {})):
        with pytest.raises(ValueError, match="max_length=20 is not supported: pass max_new_tokens"):
            model.generate_multi_block(ids, config, **keywords)
    assert model.generate_multi_block(ids, max_new_tokens=4, tokenizer=tokenizer).shape == (1, ids.shape[1] + 4)
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    assert pipe("37+50=", max_new_tokens=8)[0]["generated_text"] == "37+50=87"
    assert pipe("37+50=", max_new_tokens=8, stop_strings=["8"], tokenizer=tokenizer)[0]["generated_text"] == "37+50=8"


def test_the_checkpoints_generation_config_decides_sampling(sdar_chat, monkeypatch):
    warnings = []
    monkeypatch.setattr(hf_conventions.logger, "warning", warnings.append)
    transformers_logging.warning_once.cache_clear()
    for _ in range(2):
        cfg = merged_config(sdar_chat, None, {})
    assert (cfg.temperature, cfg.top_k, cfg.top_p) == (0.6, 20, 0.95)
    assert len(warnings) == 1 and "generation_config decided" in warnings[0] and "temperature=0.6" in warnings[0]
    greedy = merged_config(sdar_chat, BlockDiffusionConfig(temperature=0.0, max_new_tokens=8), {})
    assert (greedy.temperature, greedy.top_k, greedy.top_p) == (0, 0, 1.0)  # its top-k/top-p only when sampling
    assert len(warnings) == 1
    assert merged_config(sdar_chat, as_given(BlockDiffusionConfig()), {}).temperature == 0  # the bench's, the demo's
    assert merged_config(sdar_chat, None, {"temperature": 0}).temperature == 0  # a keyword wins
    assert merged_config(sdar_chat, BlockDiffusionConfig(temperature=0.0), {}).temperature == 0  # set, if default
    assert merged_config(sdar_chat, BlockDiffusionConfig(top_k=5), {}).top_k == 5
    preset = merged_config(sdar_chat, BlockDiffusionConfig.from_preset("sdar"), {})
    assert (preset.threshold, preset.temperature) == (0.85, 0.6)


def test_an_unconfigured_call_samples_as_the_checkpoint_says(sdar_chat):
    ids = torch.tensor([[5, 6, 7]])
    sampled = sdar_chat.generate_multi_block(ids, max_new_tokens=8, generator=torch.Generator().manual_seed(3),
                                             return_dict=True)
    explicit = BlockDiffusionConfig(max_new_tokens=8, temperature=0.6, top_k=20, top_p=0.95)
    same = sdar_chat.generate_multi_block(ids, explicit, generator=torch.Generator().manual_seed(3), return_dict=True)
    greedy = sdar_chat.generate_multi_block(ids, max_new_tokens=8, temperature=0, return_dict=True)
    assert torch.equal(sampled.logprobs, same.logprobs)
    assert not torch.equal(sampled.logprobs, greedy.logprobs)


def test_explicit_fields_survive_replace_and_from_preset():
    greedy = BlockDiffusionConfig(temperature=0.0)
    assert greedy.explicit_fields == {"temperature"}
    assert BlockDiffusionConfig(top_k=3).replace(top_p=1.0).explicit_fields == {"top_k", "top_p"}
    assert BlockDiffusionConfig.from_preset("sdar", block_size=8).explicit_fields == {"preset", "block_size"}
    every = {f.name for f in dataclasses.fields(BlockDiffusionConfig)}  # dataclasses.replace passes every field
    assert dataclasses.replace(greedy, top_k=3).explicit_fields == every
    assert copy.deepcopy(greedy).explicit_fields == {"temperature"}
    assert pickle.loads(pickle.dumps(greedy)).explicit_fields == {"temperature"}


def test_a_derived_field_follows_its_source_unless_passed(demo):
    model, _ = demo
    dream = BlockDiffusionConfig.from_preset("dream", max_new_tokens=64)
    assert dream.explicit_fields == {"preset", "max_new_tokens"}
    assert merged_config(model, dream, {"max_new_tokens": 32}).block_size == 32
    fixed = BlockDiffusionConfig.from_preset("dream", max_new_tokens=64, block_size=16)
    assert merged_config(model, fixed, {"max_new_tokens": 32}).block_size == 16
    assert merged_config(model, dataclasses.replace(dream, block_size=16), {"max_new_tokens": 32}).block_size == 16


def test_generate_and_pipeline_decode_by_block_diffusion(demo):
    model, tokenizer = demo
    enc = tokenizer("37+50=", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=8)
    assert tokenizer.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True) == "87"
    text = pipeline("text-generation", model=model, tokenizer=tokenizer)("37+50=", max_new_tokens=8)
    assert text[0]["generated_text"] == "37+50=87"
    assert Qwen3ForCausalLM.generate is GenerationMixin.generate  # autoregressive classes keep their own


def test_cli_preset(capsys):
    assert main(["generate", "--model", "demo", "--prompt", "37+50=", "--preset", "sdar",
                 "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.strip() == "87"
    assert main(["generate", "--model", "demo", "--prompt", "37+50=", "--preset", "nope"]) == 2
    error = capsys.readouterr().err.strip()
    assert "Unknown preset 'nope'" in error and "\n" not in error


def test_a_keyword_do_sample_wins_over_the_generation_configs_do_sample(demo):
    """generate merges the GenerationConfig and the keywords before it reads them: do_sample=True over its
    do_sample=False samples at its temperature (it was refused as do_sample=False with temperature 0.7)."""
    model, _ = demo
    config = GenerationConfig(do_sample=False, temperature=0.7, max_new_tokens=8)
    merged = merged_config(model, config, {"do_sample": True})
    assert (merged.temperature, merged.max_new_tokens) == (0.7, 8)


def test_replace_carries_a_derived_field_along_unless_it_was_set():
    """Dream's one block follows max_new_tokens through replace (lm-eval's max_gen_toks), unless set."""
    dream = BlockDiffusionConfig.from_preset("dream", max_new_tokens=64)
    assert dream.replace(max_new_tokens=32).block_size == 32
    fixed = BlockDiffusionConfig.from_preset("dream", max_new_tokens=64, block_size=16)
    assert fixed.replace(max_new_tokens=32).block_size == 16


def test_none_is_unset_as_in_generate_and_generates_named_arguments_at_their_defaults_pass(demo):
    model, tokenizer = demo
    enc = tokenizer("37+50=", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=8, top_k=None, temperature=None, synced_gpus=False,
                         assistant_model=None)
    assert tokenizer.decode(out[0, enc.input_ids.shape[1]:], skip_special_tokens=True) == "87"
    with pytest.raises(ValueError, match="max_new_tokens=None is invalid"):
        BlockDiffusionConfig(max_new_tokens=None)
    with pytest.raises(ValueError, match="synced_gpus=True: block-diffusion decoding does not support it"):
        merged_config(model, None, {"synced_gpus": True})
    assert merged_config(model, None, {"disable_compile": True}).runtime.compile is False  # TRL passes it
    assert merged_config(model, BlockDiffusionConfig(compile=True), {"disable_compile": True}).runtime.compile is False


def test_a_sampled_lm_eval_request_takes_the_checkpoints_then_transformers_sampling_defaults(sdar_chat):
    given = hf_conventions.sampling_fields(sdar_chat, {"temperature": 0.5})
    assert given == {"temperature": 0.5, "top_k": 20, "top_p": 0.95}
    sdar_chat.generation_config = GenerationConfig()
    assert hf_conventions.sampling_fields(sdar_chat, {}) == {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
