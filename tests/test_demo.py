"""The bundled demo model: quality of the decoding strategies on held-out problems, the demo command's output, and
its errors."""

import dataclasses
import json

import pytest
import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.assets import demo_model_path
from hf_blockdiff.cli import main
from hf_blockdiff.tools.demo import DEMO_SEED, STRATEGIES, load_demo, solve
from hf_blockdiff.tools.tasks import make_problems
from hf_blockdiff.tools.train_tiny import answer_room

NEW_TOKENS = answer_room("demo", 4)  # what the demo decodes: 8


@pytest.fixture(scope="module")
def demo():
    model, tokenizer = load_demo(None)
    return model, tokenizer, make_problems(200, DEMO_SEED, "held_out")


def accuracy(demo, label):
    model, tokenizer, problems = demo
    return solve(model, tokenizer, problems, BlockDiffusionConfig(max_new_tokens=NEW_TOKENS, **STRATEGIES[label]))


def test_checkpoint_ships_in_the_package():
    path = demo_model_path()
    assert (path / "model.safetensors").stat().st_size < 10 * 2**20
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "sdar" and config["block_size"] == 4 and "mask_token_id" in config


def test_strategy_quality(demo):
    sequential = accuracy(demo, "sequential")
    dynamic = accuracy(demo, "low_confidence_dynamic")
    multi = accuracy(demo, "multi_block (K=2)")
    assert sequential.accuracy >= 0.95
    assert dynamic.accuracy >= 0.9 * sequential.accuracy and dynamic.tokens_per_forward > 1.5
    assert multi.accuracy >= 0.9 * sequential.accuracy


def test_demo_json_can_be_recomputed(demo, capsys):
    assert main(["demo", "--num-problems", "12", "--seed", "7", "--strategy", "sequential",
                 "low_confidence_dynamic", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    from hf_blockdiff.tools.tasks import is_correct

    for row in report["results"]:
        label = row["strategy"]
        recomputed = sum(is_correct(p["prompt"], p["outputs"][label]) for p in report["problems"]) / 12
        assert row["accuracy"] == pytest.approx(recomputed) and row["num_forwards"] > 0
    model, tokenizer, _ = demo
    first = report["problems"][0]
    ids = tokenizer(first["prompt"], return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate_multi_block(ids, BlockDiffusionConfig(max_new_tokens=NEW_TOKENS, strategy="sequential"))
    assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == first["outputs"]["sequential"]


def test_demo_table(capsys):
    assert main(["demo", "--num-problems", "10"]) == 0
    table = capsys.readouterr().out
    assert all(label in table for label in STRATEGIES)


def test_demo_errors(tmp_path, capsys):
    assert main(["demo", "--strategy", "nope"]) == 2
    assert "unknown strategy 'nope'" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{not json")
    assert main(["demo", "--model", str(tmp_path)]) == 2
    assert "is not a readable demo checkpoint" in capsys.readouterr().err
    assert main(["demo", "--task", "hard", "--num-problems", "2"]) == 2
    assert "its tokenizer lacks characters of task 'hard'" in capsys.readouterr().err


def test_demo_on_a_hard_task_checkpoint(tmp_path, capsys):
    """A (briefly trained) hard-family checkpoint: the table decodes the hard problems with room for 36-token
    answers."""
    from hf_blockdiff.tools.train_tiny import PRESETS, build_model, save_checkpoint
    from hf_blockdiff.tools.tasks import build_tokenizer

    small = dataclasses.replace(PRESETS["hard"].model, hidden_size=32, num_layers=1, head_dim=8,
                                intermediate_size=64)
    tokenizer = build_tokenizer("hard")
    save_checkpoint(build_model(small, tokenizer), tokenizer, str(tmp_path))
    assert main(["demo", "--task", "hard", "--model", str(tmp_path), "--num-problems", "3", "--strategy",
                 "sequential", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["expected"] for p in report["problems"]] == [a for _, a in make_problems(3, 1234, "held_out", task="hard")]
    assert report["results"][0]["num_forwards"] >= 40  # one token per forward over 40 new tokens, prefill besides


def test_fresh_training_reaches_the_shipped_accuracy_trend():
    """A short run of the training script from scratch: the loss falls well below its start (the full run is
    documented in hf_blockdiff/tools/train_tiny.py)."""
    from hf_blockdiff.tools.train_tiny import TrainConfig, fit

    torch.set_num_threads(2)
    losses = fit(TrainConfig(batch_size=32), seed=0, steps=40, log=None).losses
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10
