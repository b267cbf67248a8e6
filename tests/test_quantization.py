"""Quantized weights on the fast path: a torchao int8 weight-only model decodes as the plain reference loop decodes
the same quantized model; LoRA pre-merge refuses quantized base weights; bitsandbytes turns graphs and compile off
(logged); other quantization methods are refused before any forward."""

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, TorchAoConfig

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.attention import resolve_backend
from hf_blockdiff.cli import main
from hf_blockdiff.generation.engine import use_graphs
from hf_blockdiff.fusion.mode import fusion_for
from helpers import MASK, left_pad, random_prompts, tiny_model
from reference_loops import sdar_reference

torchao = pytest.importorskip("torchao", reason="torchao is the quant extra: pip install -e '.[quant]' (CI installs it)")

SETTINGS = dict(mask_token_id=MASK, block_size=4, max_new_tokens=12, strategy="low_confidence_dynamic",
                threshold=0.6, attention="block_causal", eos_token_id=[], fused_store=False)


@pytest.fixture(scope="module")
def int8_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("int8")
    tiny_model("qwen3").save_pretrained(directory)
    config = TorchAoConfig(torchao.quantization.Int8WeightOnlyConfig())
    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=config, dtype=torch.float32).eval()


@pytest.mark.parametrize("graphs", [False, True])
def test_int8_weight_only_decodes_as_the_reference_loop(int8_model, graphs):
    assert type(int8_model.model.layers[0].mlp.up_proj.weight).__module__.startswith("torchao")
    prompts = random_prompts((8, 5, 11), seed=21)
    ids, mask = left_pad(prompts)
    cfg = BlockDiffusionConfig(**SETTINGS, cuda_graphs=graphs)
    out = int8_model.generate_multi_block(ids, cfg, attention_mask=mask)[:, ids.shape[1]:]
    for row, prompt in enumerate(prompts):
        tokens, _ = sdar_reference(int8_model, prompt, MASK, 4, 4, 12, "low_confidence_dynamic", 0.6)
        assert out[row].tolist() == tokens.tolist()
    plain = tiny_model("qwen3").generate_multi_block(ids, cfg, attention_mask=mask)[:, ids.shape[1]:]
    assert not torch.equal(out, plain)  # the int8 weights decode differently: the model under test is quantized


def test_lora_pre_merge_refuses_quantized_base_weights(int8_model):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(int8_model, peft.LoraConfig(r=4, target_modules=["v_proj"], init_lora_weights=False))
    with pytest.raises(ValueError, match="LoRA pre-merge: the base weights .* are quantized"):
        model.generate_multi_block(torch.tensor([[5, 6, 7]]), BlockDiffusionConfig(**SETTINGS))
    model.unload()


def test_unsupported_quantization_is_refused_before_any_forward():
    model = tiny_model("qwen3")
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ValueError, match="quantized with 'gptq'"):
        model.generate_multi_block(torch.tensor([[5, 6, 7]]), BlockDiffusionConfig(**SETTINGS))
    assert getattr(model, "_blockdiff_engine", None) is None


def test_bitsandbytes_turns_graphs_and_compile_off_with_one_log_line(caplog):
    """bitsandbytes needs CUDA; what the fast path decides for such a model is checked on its config."""
    model = tiny_model("qwen3")
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    cuda, cfg = torch.device("cuda"), BlockDiffusionConfig(**SETTINGS)
    backend = resolve_backend("triton", cuda, 4, 64)
    with caplog.at_level(logging.WARNING):
        assert not use_graphs(cfg, backend, cuda, model)
        assert fusion_for(cfg, backend, True, cuda, model, 64) != "compile"
    assert "CUDA graphs and torch.compile of the decoder layers are turned off" in caplog.text
    assert use_graphs(cfg, backend, cuda, tiny_model("qwen3"))  # the same settings without bitsandbytes


def test_int8_weights_keep_graphs_and_turn_compile_off_by_default(int8_model, caplog):
    """torchao int8 weight-only layers decode slower compiled (README): graphs stay on, compile is off unless asked."""
    cuda, cfg = torch.device("cuda"), BlockDiffusionConfig(**SETTINGS)
    backend = resolve_backend("triton", cuda, 4, 64)
    with caplog.at_level(logging.WARNING):
        assert use_graphs(cfg, backend, cuda, int8_model)
        assert fusion_for(cfg, backend, True, cuda, int8_model, 64) != "compile"
    assert "Int8Tensor weights: torch.compile of the decoder layers is off by default" in caplog.text
    assert fusion_for(cfg.replace(compile=True), backend, True, cuda, int8_model, 64) == "compile"
    assert fusion_for(cfg, backend, True, cuda, tiny_model("qwen3"), 64) == "compile"


def test_bench_quantized_weights(capsys):
    """--quantization int8 runs the fast path on torchao int8 weight-only layers; nf4 needs a checkpoint."""
    code = main(["bench", "--shape", "tiny", "--batch-size", "2", "--prompt-len", "9", "--new-tokens", "8",
                 "--device", "cpu", "--dtype", "float32", "--quantization", "int8", "--skip-reference", "--json"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and report["settings"]["quantization"] == "int8" and report["results"][0]["tokens"] == 16
    assert main(["bench", "--shape", "tiny", "--device", "cpu", "--quantization", "nf4"]) == 2
    assert "pass --model DIR" in capsys.readouterr().err
