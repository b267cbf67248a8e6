"""The GPU model matrix (tools/model_matrix.py) on the CPU: the tiny shape through every path and the correctness
cell, a failing cell reported while the matrix goes on, mask ids left counted, and the released shapes' facts."""

import json
from types import SimpleNamespace

import pytest
import torch

from hf_blockdiff.config.profiles import profile_for
from hf_blockdiff.tools import model_matrix
from hf_blockdiff.tools.bench_models import SHAPES, shape_config


def run(tmp_path, *extra):
    output = tmp_path / "matrix.jsonl"
    records = model_matrix.main(["--families", "tiny", "--batches", "2", "--prompt-len", "8", "--new-tokens", "4",
                                 "--device", "cpu", "--output", str(output), *extra])
    return records, [json.loads(line) for line in output.read_text().splitlines()]


def test_tiny_shape_through_both_paths_and_the_correctness_cell(tmp_path, capsys):
    records, lines = run(tmp_path)
    assert lines == records
    assert [(r["path"], r["batch"], r["layers"], r["dtype"]) for r in records] == [
        ("fast", 2, 4, "bfloat16"), ("eager-sdpa", 2, 4, "bfloat16"), ("fast = eager-sdpa", 2, 2, "float32")]
    fast, eager, correctness = records
    for cell in (fast, eager):
        assert cell["ok"] and cell["mask_left"] == 0 and cell["tok_s"] > 0 and cell["new_tokens"] == 4
        assert cell["tokens"] == 8 and cell["forwards"] > 0
    assert correctness["ok"] and correctness["equal"] and correctness["first_difference"] is None
    table = capsys.readouterr().out
    assert "| tiny | 4 | 2 | fast | bfloat16 | ok | 0 |" in table
    assert "| tiny | 2 | 2 | fast = eager-sdpa | float32 | equal |" in table


def test_a_failing_cell_is_reported_and_the_matrix_goes_on(tmp_path, monkeypatch, capsys):
    def speed_cell(model, batch, path, args):
        if path == "fast":
            raise RuntimeError("kernel launch failed\nsecond line")
        return {"new_tokens": 4, "tok_s": 1.5, "mask_left": 3}

    monkeypatch.setattr(model_matrix, "speed_cell", speed_cell)
    monkeypatch.setattr(model_matrix, "correctness_cell", lambda shape, args: {"equal": False,
                                                                               "first_difference": [1, 3]})
    records, _ = run(tmp_path, "--layers", "1")
    assert [(r["path"], r["ok"], r["layers"]) for r in records] == [
        ("fast", False, 1), ("eager-sdpa", True, 1), ("fast = eager-sdpa", True, 2)]
    assert records[0]["error"] == "RuntimeError: kernel launch failed"
    table = capsys.readouterr().out
    assert "| error | | | RuntimeError: kernel launch failed |" in table.replace("  ", " ")
    assert "| mask ids left | 3 | 1.5 |" in table
    assert "| differ | | | first difference at [1, 3] |" in table.replace("  ", " ")


def test_a_family_that_cannot_be_built_fails_every_speed_cell(tmp_path, monkeypatch):
    def build(shape, layers, device, dtype):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(model_matrix, "build", build)
    records, _ = run(tmp_path)
    assert [r["ok"] for r in records] == [False, False, False]
    assert {r["error"] for r in records} == {"OutOfMemoryError: CUDA out of memory"}


def test_mask_ids_left_in_the_generated_tokens_are_counted(tmp_path, monkeypatch):
    def decode(model, ids, attention, new_tokens, path):
        return torch.tensor([[1, 4095, 2, 4095], [4095, 5, 6, 7]]), 5

    monkeypatch.setattr(model_matrix, "decode", decode)
    monkeypatch.setattr(model_matrix, "correctness_cell", lambda shape, args: {"equal": True,
                                                                               "first_difference": None})
    records, _ = run(tmp_path)
    assert [r["mask_left"] for r in records[:2]] == [3, 3]  # tiny's mask id is the last of its 4096


def test_a_canvas_model_generates_whole_canvases():
    canvas = SimpleNamespace(config=SimpleNamespace(model_type="diffusion_gemma", canvas_length=256))
    blocks = SimpleNamespace(config=SimpleNamespace(model_type="sdar"))
    assert [model_matrix.generated_length(canvas, n) for n in (1, 256, 257)] == [256, 256, 512]
    assert model_matrix.generated_length(blocks, 65) == 65


@pytest.mark.parametrize("argument", [["--families", "sdar-9b"], ["--batches", "0,8"], ["--batches", "x"],
                                      ["--layers", "0"]])
def test_bad_arguments_are_refused_before_any_model(argument, capsys):
    with pytest.raises(SystemExit):
        model_matrix.parse(argument)
    assert argument[0] in capsys.readouterr().err


def test_every_released_family_has_a_shape_with_its_released_facts():
    assert set(model_matrix.FAMILIES) <= set(SHAPES)
    facts = {  # shape: (model type, hidden, layers, heads, KV heads, vocab, mask id)
        "sdar-1.7b": ("sdar", 2048, 28, 16, 8, 151936, 151669),
        "sdar-4b": ("sdar", 2560, 36, 32, 8, 151936, 151669),
        "sdar-8b": ("sdar", 4096, 36, 32, 8, 151936, 151669),
        "sdar-30b-a3b": ("sdar_moe", 2048, 48, 32, 4, 151936, 151669),
        "llada-8b": ("llada", 4096, 32, 32, 32, 126464, 126336),
        "llada2-mini": ("llada2_moe", 2048, 20, 16, 4, 157184, 156895),
        "dream-7b": ("Dream", 3584, 28, 28, 4, 152064, 151666),
        "fast-dllm-v2-7b": ("Fast_dLLM_Qwen", 3584, 28, 28, 4, 152064, 151665),
    }
    for shape, expected in facts.items():
        config = shape_config(shape)
        profile = profile_for(config)
        assert (config.model_type, config.hidden_size, config.num_hidden_layers, config.num_attention_heads,
                config.num_key_value_heads, config.vocab_size, profile.mask_token_id) == expected, shape
    moe = shape_config("sdar-30b-a3b", layers=8)
    assert (moe.num_hidden_layers, moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (
        8, 128, 8, 768)
    assert profile_for(shape_config("fast-dllm-v2-7b")).block_size == 32
    assert shape_config("llada-8b", layers=8).n_layers == 8
