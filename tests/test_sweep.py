"""The strategy sweep (`hf-blockdiff demo --sweep`), its saved reports and the bundled hard-task model."""

import json
from pathlib import Path

import pytest

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.assets import BUNDLED_MODELS
from hf_blockdiff.cli import main
from hf_blockdiff.tools import sweep
from hf_blockdiff.tools.demo import load_demo
from hf_blockdiff.tools.tasks import Solved, is_correct, make_problems, solve
from hf_blockdiff.tools.train_tiny import answer_room

REPORTS = sorted((Path(__file__).parents[1] / "docs" / "sweep").glob("*.json"))


def row(accuracy, tokens_per_forward):
    setting = sweep.Setting("single-block", "sequential", sweep.STEPS, 4, {})
    greedy = Solved(accuracy, 1, tokens_per_forward, 0.0, [])
    return sweep.SweepRow(setting, greedy, greedy, accuracy, accuracy)


def test_pareto_front_keeps_the_points_nothing_beats():
    rows = [row(0.95, 1.0), row(0.95, 2.8), row(0.9, 2.8), row(0.8, 3.6), row(0.7, 3.0), row(0.8, 3.6)]
    sweep.mark_front(rows)
    assert [r.on_front for r in rows] == [False, True, False, True, False, True]  # equal points share the front


def test_settings_cover_every_strategy_and_refuse_values_outside_their_range():
    chosen = sweep.settings(None, {}, block_size=4)
    assert {s.strategy for s in chosen} == set(sweep.SETTINGS)
    assert all(2 <= sum(s.strategy == name and s.mode == "single-block" for s in chosen) <= 3 for name in sweep.SETTINGS)
    assert {s.mode for s in chosen} == set(sweep.MODES)
    assert [s.value for s in sweep.settings(["relative_top"], {"relative_top": (0.8,)}, 4)] == [0.8]
    with pytest.raises(ValueError, match=r"--set relative_top=1.5 is outside the strategy's range: .*relative_alpha"):
        sweep.settings(["relative_top"], {"relative_top": (1.5,)}, 4)
    with pytest.raises(ValueError, match=r"low_confidence_dynamic=1.2 is outside .*threshold in \[0.0, 1.0\]"):
        sweep.settings(None, {"low_confidence_dynamic": (1.2,)}, 4)
    with pytest.raises(ValueError, match="steps_per_block must be a whole number from 1 to the model's block size 4"):
        sweep.settings(["sequential"], {"sequential": (8,)}, 4)
    with pytest.raises(ValueError, match="unknown strategy 'nope' for --sweep: choose from sequential"):
        sweep.settings(["nope"], {}, 4)
    with pytest.raises(ValueError, match="unknown strategy 'nope': choose from sequential"):
        sweep.parse_overrides(["nope=1"])
    with pytest.raises(ValueError, match=r"give threshold values as numbers, e.g. dynamic_pmax=0.9,0.5"):
        sweep.parse_overrides(["dynamic_pmax=high"])


@pytest.fixture(scope="module")
def hard():
    return load_demo("hard")


def test_the_bundled_hard_model_solves_its_task_on_the_cpu(hard):
    """The shipped weights (bf16, decoded in fp32): sequential decoding and a threshold rule at ~3 tokens per
    forward both solve most held-out problems; committing a whole block at once does worse."""
    model, tokenizer = hard
    path = BUNDLED_MODELS["hard"]
    assert (path / "model.safetensors").stat().st_size < 25 * 2**20
    assert json.loads((path / "training.json").read_text())["task"] == "hard" and model.config.block_size == 4
    problems = make_problems(24, 99, "held_out", task="hard")
    room = answer_room("hard", 4)
    sequential = solve(model, tokenizer, problems, BlockDiffusionConfig(max_new_tokens=room, strategy="sequential"))
    dynamic = solve(model, tokenizer, problems, BlockDiffusionConfig(max_new_tokens=room, threshold=0.9))
    at_once = solve(model, tokenizer, problems, BlockDiffusionConfig(max_new_tokens=room, steps_per_block=1,
                                                                     strategy="low_confidence_static"))
    assert sequential.accuracy >= 0.8 and dynamic.accuracy >= 0.8 and dynamic.tokens_per_forward >= 2
    assert at_once.accuracy < sequential.accuracy


def test_sweep_json_recomputes_and_regenerates(hard, tmp_path, capsys):
    """A small sweep: each accuracy and pass@k recomputes from the outputs it lists, a greedy row re-generates with
    `generate_multi_block`, the plot is a PNG, and two parts of the sweep read as one."""
    args = ["demo", "--model", "hard", "--sweep", "--num-problems", "3", "--samples", "2", "--json"]
    assert main(args + ["--strategy", "sequential", "--plot", str(tmp_path / "a.png")]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(args + ["--strategy", "dynamic_pmax", "--set", "dynamic_pmax=0.5"]) == 0
    second = json.loads(capsys.readouterr().out)
    for result in first["results"] + second["results"]:
        problems = (first if result in first["results"] else second)["problems"]
        label = result["label"]
        correct = sum(is_correct(p["prompt"], p["outputs"][label]) for p in problems)
        assert result["accuracy"] == pytest.approx(correct / 3, abs=1e-4)
        solved = [[is_correct(p["prompt"], text) for text in p["samples"][label]] for p in problems]
        assert result["pass@2"] == pytest.approx(sum(map(any, solved)) / 3, abs=1e-4)
        assert result["pass@1"] == pytest.approx(sum(map(sum, solved)) / 6, abs=1e-4)
    model, tokenizer = hard
    problem = second["problems"][0]
    ids = tokenizer(problem["prompt"], return_tensors="pt", add_special_tokens=False).input_ids
    out = model.generate_multi_block(ids, BlockDiffusionConfig(max_new_tokens=answer_room("hard", 4),
                                                               strategy="dynamic_pmax", threshold=0.5))
    assert tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True) == problem["outputs"]["dynamic_pmax threshold=0.5"]
    for i, report in enumerate((first, second)):
        (tmp_path / f"{i}.json").write_text(json.dumps(report))
    assert main(["demo", "--from-json", str(tmp_path / "0.json"), str(tmp_path / "1.json"), "--json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert [r["label"] for r in merged["results"]] == [r["label"] for r in first["results"] + second["results"]]


def test_saved_reports_hold_the_readme_claims(capsys):
    """The README's strategy table comes from docs/sweep/*.json: the best and worst settings differ by 10 points or
    more, and a multi-token rule keeps 95 % of sequential decoding's accuracy at 2 or more tokens per forward."""
    assert main(["demo", "--from-json", *map(str, REPORTS), "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    accuracy = {r["label"]: r["accuracy"] for r in results}
    assert max(accuracy.values()) - min(accuracy.values()) >= 0.10
    sequential = accuracy["sequential steps_per_block=4"]
    assert any(r["accuracy"] >= 0.95 * sequential and r["tokens_per_forward"] >= 2 for r in results)
    assert any(r["pareto"] for r in results)


def test_sweep_errors(tmp_path, capsys):
    assert main(["demo", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--set and --plot are options of --sweep" in capsys.readouterr().err
    assert main(["demo", "--from-json", str(tmp_path / "missing.json")]) == 2
    assert "missing.json: not a readable sweep report" in capsys.readouterr().err
    a = {"problems": [{"prompt": "1+1=", "expected": "2"}], "samples": 4, "results": []}
    b = dict(a, samples=2)
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main(["demo", "--from-json", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 2
    assert "the reports decode other problems or sample counts" in capsys.readouterr().err
    assert main(["demo", "--model", "hard", "--sweep", "--samples", "0"]) == 2
    assert "--samples 0: pass a positive number" in capsys.readouterr().err
