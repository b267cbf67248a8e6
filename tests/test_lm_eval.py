"""lm-eval's `hf-blockdiff` model on a local task (tests/fixtures/lm_eval: a YAML task over a JSONL file, offline)."""

import json
import sys
from pathlib import Path

import pytest

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.cli import main
from hf_blockdiff.integrations.checkpoint import load_pretrained
from hf_blockdiff.integrations.completions import complete

pytest.importorskip("lm_eval")

TASK = Path(__file__).parent / "fixtures" / "lm_eval"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.chdir(TASK)  # the task's data_files path is relative
    for name, value in {**OFFLINE, "HF_DATASETS_CACHE": str(tmp_path / "datasets")}.items():
        monkeypatch.setenv(name, value)


def test_simple_evaluate_decodes_the_task(checkpoint, offline):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from hf_blockdiff.integrations.lm_eval import cut

    results = simple_evaluate(model="hf-blockdiff", model_args=f"pretrained={checkpoint},threshold=0.6",
                              tasks=["blockdiff_tiny"],
                              task_manager=TaskManager(include_path=str(TASK), include_defaults=False),
                              batch_size=2, device="cpu", log_samples=True)
    docs = [json.loads(line) for line in (TASK / "blockdiff_tiny.jsonl").read_text().splitlines()]
    model, tokenizer = load_pretrained(str(checkpoint))
    cfg = BlockDiffusionConfig(threshold=0.6, max_new_tokens=12)  # max_gen_toks of the task
    expected = [cut(c.text, ["\n", "."]) for c in complete(model, [d["question"] for d in docs], cfg, tokenizer)]
    samples = sorted(results["samples"]["blockdiff_tiny"], key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in samples] == expected
    accuracy = sum(e == d["answer"] for e, d in zip(expected, docs)) / len(docs)
    assert results["results"]["blockdiff_tiny"]["exact_match,none"] == pytest.approx(accuracy)


def test_loglikelihood_is_refused(checkpoint):
    from hf_blockdiff.integrations.lm_eval import BlockDiffusionLM

    lm = BlockDiffusionLM(pretrained=str(checkpoint), device="cpu")
    for method in (lm.loglikelihood, lm.loglikelihood_rolling):
        with pytest.raises(NotImplementedError, match="not supported for diffusion decoding"):
            method([])
    with pytest.raises(ValueError, match=r"unknown model_args \['blok_size'\]"):
        BlockDiffusionLM(pretrained=str(checkpoint), blok_size=4)


def test_the_command_line(checkpoint, offline, monkeypatch, capsys):
    """`hf-blockdiff lm-eval` in this process (lm_eval's command line reads `sys.argv`: restored after)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    code = main(["lm-eval", "--model", "hf-blockdiff", "--model_args",
                 f"pretrained={checkpoint},block_size=4,threshold=0.6", "--tasks", "blockdiff_tiny", "--include_path",
                 str(TASK), "--device", "cpu", "--batch_size", "4"])
    out = capsys.readouterr().out
    assert code == 0 and "blockdiff_tiny" in out and "exact_match" in out


def test_a_greedy_request_stays_greedy_on_a_sampling_checkpoint(checkpoint):
    from transformers import GenerationConfig

    from hf_blockdiff.generation.hf_conventions import merged_config
    from hf_blockdiff.integrations.lm_eval import BlockDiffusionLM

    lm = BlockDiffusionLM(pretrained=str(checkpoint), device="cpu")
    lm.model.generation_config = GenerationConfig(do_sample=True, temperature=0.6)

    def temperature(gen_kwargs: dict) -> float:
        return merged_config(lm.model, lm._request_config(gen_kwargs)[0], {}).temperature

    assert temperature({"until": ["\n"], "do_sample": False}) == temperature({"until": ["\n"]}) == 0
    assert temperature({"do_sample": True, "temperature": 0.8}) == 0.8
    lm.config = BlockDiffusionConfig(temperature=0.5)  # model_args win over the request's greedy default
    assert temperature({"do_sample": False}) == 0.5
