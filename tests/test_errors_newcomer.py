"""What a new user hit first: the demo's problem count, patching a model that is no causal LM, the CLI's default
length on the small demo model, a deprecation warning on loading it, and flags without help."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_blockdiff
from hf_blockdiff.assets import demo_model_path
from hf_blockdiff.cli import build_parser, main
from hf_blockdiff.config import ATTENTION_BACKENDS
from hf_blockdiff.strategies import strategy_names

ROOT = Path(__file__).resolve().parents[1]


def last_error(capsys) -> str:
    err = capsys.readouterr().err.splitlines()
    assert err and err[-1].startswith("hf-blockdiff: error: ")
    return err[-1]


@pytest.mark.parametrize("count", ["0", "-3"])
def test_demo_needs_a_positive_problem_count(capsys, count):
    assert main(["demo", "--num-problems", count]) == 2
    assert f"--num-problems {count}: pass a positive number" in last_error(capsys)


@pytest.fixture
def unpatched():
    """Classes patch_model patches keep `generate_multi_block` only for the test."""
    import transformers

    names = ("T5ForConditionalGeneration", "BertForMaskedLM", "MistralForCausalLM")
    before = {name: "generate_multi_block" in vars(getattr(transformers, name)) for name in names}
    yield
    for name, had in before.items():
        if not had and "generate_multi_block" in vars(getattr(transformers, name)):
            delattr(getattr(transformers, name), "generate_multi_block")


def tiny(kind: str):
    from transformers import (BertConfig, BertForMaskedLM, MistralConfig, MistralForCausalLM, T5Config,
                              T5ForConditionalGeneration)

    torch.manual_seed(0)
    if kind == "t5":
        return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                                   d_kv=16))
    if kind == "bert":
        return BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2))
    return MistralForCausalLM(MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8)).eval()


@pytest.mark.parametrize("kind", ["t5", "bert"])
def test_patch_model_refuses_what_is_no_decoder_only_causal_lm(unpatched, kind):
    with pytest.raises((TypeError, ValueError), match="decoder-only causal LM"):
        hf_blockdiff.patch_model(tiny(kind))


def test_patch_model_takes_a_causal_lm_outside_the_stock_classes(unpatched):
    model = hf_blockdiff.patch_model(tiny("mistral"))
    cfg = hf_blockdiff.BlockDiffusionConfig(mask_token_id=63, block_size=4, attention="block_causal",
                                            max_new_tokens=8, eos_token_id=[])
    assert model.generate_multi_block(torch.randint(0, 60, (2, 5)), cfg).shape == (2, 13)


def test_generate_on_the_demo_model_fits_its_positions(capsys):
    assert main(["generate", "--model", "demo", "--prompt", "37+50="]) == 0
    out, err = capsys.readouterr()
    assert out == "87\n"
    # 64 positions, a prompt of 6 tokens, blocks of 4: 56 new tokens
    notes = [line for line in err.splitlines() if "note:" in line]
    assert len(notes) == 1 and notes[0].startswith("hf-blockdiff: note: --max-new-tokens not given: generating 56 tokens")


def test_a_given_max_new_tokens_is_kept(capsys):
    assert main(["generate", "--model", str(demo_model_path()), "--prompt", "37+50=", "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    assert out == "87\n" and "note:" not in err


def test_a_prompt_that_leaves_no_room_is_one_error(capsys):
    assert main(["generate", "--model", "demo", "--prompt", "1" * 62]) == 2
    assert "leave no room for a block of 4 new tokens" in last_error(capsys)


def test_the_readme_cpu_snippet_runs(capsys):
    readme = (ROOT / "README.md").read_text()
    snippet = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S) if "demo_model_path" in block)
    exec(snippet, {})
    assert "['87', '12359']" in capsys.readouterr().out


def test_the_demo_checkpoint_config_is_clean():
    config = json.loads((demo_model_path() / "config.json").read_text())
    assert config["dtype"] == "float32" and "torch_dtype" not in config


def test_train_tiny_writes_a_clean_config(tmp_path):
    from hf_blockdiff.tools.tasks import build_tokenizer
    from hf_blockdiff.tools.train_tiny import TinyModelConfig, build_model, save_checkpoint

    tokenizer = build_tokenizer()
    save_checkpoint(build_model(TinyModelConfig(hidden_size=32, head_dim=8, intermediate_size=64), tokenizer),
                    tokenizer, str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == "float32" and "torch_dtype" not in config


def test_loading_the_demo_model_warns_nothing_about_torch_dtype():
    code = ("from transformers import AutoModelForCausalLM; import hf_blockdiff; "
            f"AutoModelForCausalLM.from_pretrained({str(demo_model_path())!r})")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "torch_dtype" not in run.stderr


def options():
    """(subcommand, action) of every option of every subcommand."""
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return [(name, action) for name, sub in commands.choices.items() for action in sub._actions
            if action.option_strings and not isinstance(action, argparse._HelpAction)]


def test_every_flag_has_help_that_states_its_default():
    for command, action in options():
        flag = f"{command} {action.option_strings[0]}"
        assert action.help and action.help != argparse.SUPPRESS, flag
        assert action.required or "default" in action.help, flag
    for command in ("generate", "bench", "demo", "train-tiny"):
        with pytest.raises(SystemExit):  # the help renders (no stray % in a help text)
            main([command, "--help"])


def test_choices_are_listed_in_the_help():
    helps = {(command, action.option_strings[0]): action.help for command, action in options()}
    for command in ("generate", "bench"):
        assert all(name in helps[command, "--strategy"] for name in strategy_names())
        assert all(name in helps[command, "--attention-backend"] for name in ATTENTION_BACKENDS)
    assert all(name in helps["demo", "--strategy"] for name in strategy_names())
    for flag in ("--fallback", "--alignment", "--attention", "--dtype"):
        assert "," in helps["generate", flag]


@pytest.mark.parametrize("flag,match", [("--eos-token-id", "eos_token_id=.*vocabulary"),
                                        ("--pad-token-id", "pad_token_id=.*vocabulary")])
def test_cli_ids_outside_the_vocabulary_are_one_line(capsys, flag, match):
    assert main(["generate", "--model", "demo", "--prompt", "37+50=", flag, "99999"]) == 2
    assert re.search(match, last_error(capsys))


def test_compile_on_the_cpu_decodes_without_triton_kernels(monkeypatch):
    """compile=True on a CPU model crashed inside a Triton kernel (no GPU driver): without TRITON_INTERPRET=1 the
    compiled layers are the stock ones (inductor's C++ backend), none of hf_blockdiff's Triton forwards go in, and
    the tokens are the eager ones."""
    from torch._dynamo.utils import counters

    from hf_blockdiff.fusion import mode as fusion
    from hf_blockdiff.integrations.checkpoint import load_pretrained

    model, tokenizer = load_pretrained(str(demo_model_path()))
    ids = tokenizer(["37+50="], return_tensors="pt").input_ids
    cfg = hf_blockdiff.BlockDiffusionConfig(max_new_tokens=8)
    eager = model.generate_multi_block(ids, cfg)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as on a CPU machine outside the tests

    def no_triton(*args, **kwargs):
        raise AssertionError("a Triton forward was installed where no Triton kernel can run")

    monkeypatch.setattr(fusion, "fused_forwards", no_triton)
    monkeypatch.setattr(fusion, "fused_experts", no_triton)
    counters.clear()
    compiled = model.generate_multi_block(ids, cfg.replace(compile=True))
    hf_blockdiff.free_cache(model)
    assert counters["stats"]["unique_graphs"] > 0  # the layers did compile
    assert torch.equal(compiled, eager)
    assert tokenizer.decode(compiled[0, ids.shape[1]:], skip_special_tokens=True).startswith("87")
