"""BlockDiffusionEvalCallback in a real Trainer (CPU): metrics logged, model state untouched, scorer errors survived."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

import hf_blockdiff
from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.integrations.completions import complete

from helpers import MASK, char_tokenizer, tiny_model

CFG = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=8, attention="block_causal",
                           threshold=0.6, eos_token_id=[])
PROMPTS = ["hello", "block diffusion", "abc", "x = 1"]


def make_trainer(model, tmp_path, **args):
    tokens = torch.randint(0, MASK, (8, 12), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": ids, "labels": ids} for ids in tokens]
    arguments = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, save_strategy="no",
                                  per_device_train_batch_size=4, per_device_eval_batch_size=4, **args)
    return Trainer(model=model, args=arguments, train_dataset=data, eval_dataset=data,
                   data_collator=default_data_collator,
                   processing_class=char_tokenizer())


def test_evaluate_logs_the_metrics_and_leaves_the_model_alone(tmp_path):
    model = tiny_model("qwen3")
    expected = complete(model, PROMPTS, CFG, char_tokenizer())
    references = [c.text for c in expected[:2]] + ["no", "match"]
    trainer = make_trainer(model, tmp_path)
    callback = hf_blockdiff.BlockDiffusionEvalCallback(PROMPTS, references, CFG, trainer=trainer)
    trainer.add_callback(callback)
    model.model.embed_tokens.weight.requires_grad_(False)
    for p in model.lm_head.parameters():
        p.grad = torch.randn_like(p)
    before = {n: (p.detach().clone(), p.requires_grad, None if p.grad is None else p.grad.clone())
              for n, p in model.named_parameters()}

    metrics = trainer.evaluate()

    assert metrics["eval_blockdiff_accuracy"] == 0.5
    logged = [entry for entry in trainer.state.log_history if "eval_blockdiff_accuracy" in entry]
    assert len(logged) == 1 and logged[0]["eval_blockdiff_accuracy"] == 0.5
    assert logged[0]["eval_blockdiff_num_forwards"] == expected.num_forwards
    assert logged[0]["eval_blockdiff_tokens_per_forward"] > 0 and logged[0]["eval_blockdiff_tok_s"] > 0
    model.train()
    model.model.layers[0].eval()  # each module's mode comes back, mixed or not
    callback.on_evaluate(trainer.args, trainer.state, trainer.control, model=model, metrics={},
                         processing_class=trainer.processing_class)
    assert model.training and model.lm_head.training and not model.model.layers[0].mlp.training
    for name, p in model.named_parameters():
        value, requires_grad, grad = before[name]
        assert torch.equal(p, value) and p.requires_grad == requires_grad
        assert (p.grad is None) == (grad is None) and (grad is None or torch.equal(p.grad, grad))


def test_tokens_per_forward_is_per_prompt_as_in_the_output(tmp_path):
    """TPF is tokens committed per decoding step of a prompt (`BlockDiffusionOutput.tokens_per_forward`): the same
    whether the prompts decode one by one or in a batch, never batch tokens over batched forwards."""
    model, tokenizer = tiny_model("qwen3"), char_tokenizer()
    alone = [model.generate_multi_block(tokenizer(p, return_tensors="pt").input_ids, CFG, return_dict=True)
             for p in PROMPTS]
    steps = [int(out.steps.sum()) for out in alone]
    expected = sum(out.tokens_per_forward * n for out, n in zip(alone, steps)) / sum(steps)
    assert len(set(steps)) > 1 and expected > 1  # prompts of different lengths, more than one token per step
    for batch_size in (1, 3, 4):
        completions = complete(model, PROMPTS, CFG, tokenizer, batch_size=batch_size)
        assert completions.tokens_per_forward == pytest.approx(expected)
        assert [c.steps for c in completions] == steps
    trainer = make_trainer(model, tmp_path)
    trainer.add_callback(hf_blockdiff.BlockDiffusionEvalCallback(PROMPTS, config=CFG, trainer=trainer))
    assert trainer.evaluate()["eval_blockdiff_tokens_per_forward"] == pytest.approx(expected)


def test_a_raising_scorer_is_reported_and_training_goes_on(tmp_path, caplog):
    def scorer(completions, references):
        raise ZeroDivisionError("bad metric")

    model = tiny_model("qwen3")
    trainer = make_trainer(model, tmp_path, max_steps=2, eval_strategy="steps", eval_steps=1, logging_steps=1)
    trainer.add_callback(hf_blockdiff.BlockDiffusionEvalCallback(PROMPTS[:2], config=CFG, scorer=scorer))
    with caplog.at_level(logging.WARNING, logger="hf_blockdiff.integrations.callbacks"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert "scorer raised ZeroDivisionError: bad metric" in caplog.text
    logged = [entry for entry in trainer.state.log_history if "eval_blockdiff_tokens_per_forward" in entry]
    assert [entry["step"] for entry in logged] == [1, 2]
    assert not any(key.startswith("eval_blockdiff_score") for entry in logged for key in entry)


def test_the_example_trains_and_logs_the_metric(tmp_path):
    example = Path(__file__).parents[1] / "examples" / "train_with_eval_callback.py"
    run = subprocess.run([sys.executable, str(example), "--steps", "3", "--output-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "step   3: accuracy" in run.stdout


def test_a_compile_cache_is_loaded_and_warmed_at_train_begin(tmp_path, monkeypatch):
    """Train begin loads the cache, decodes the first batch of prompts (compiling the bookkeeping, forced compiled as
    on CUDA), saves and frees the engine before the first training step; the evaluations decode all prompts in two
    batches, compile nothing and save nothing again."""
    from torch._dynamo.utils import counters

    from hf_blockdiff.generation import engine as engine_module
    from hf_blockdiff.generation.step import DecodeStep
    from hf_blockdiff.integrations import callbacks, compile_cache

    events = []
    model = tiny_model("qwen3")
    generate = callbacks.generate_distributed
    torch._dynamo.reset()  # what earlier tests compiled: the warm-up compiles here
    monkeypatch.setattr(engine_module, "DecodeStep", lambda scheduler, executor, _: DecodeStep(scheduler, executor,
                                                                                               True))

    def generating(model, prompts, *args, **kwargs):
        fresh, before = getattr(model, "_blockdiff_engine", None) is None, counters["frames"]["ok"]
        out = generate(model, prompts, *args, **kwargs)
        events.append(("generate", len(prompts), fresh, counters["frames"]["ok"] > before))
        return out

    monkeypatch.setattr(callbacks, "generate_distributed", generating)
    monkeypatch.setattr(compile_cache, "load", lambda model, directory: events.append(("load", directory)))
    monkeypatch.setattr(compile_cache, "save", lambda model, directory: events.append(("save", directory)))
    trainer = make_trainer(model, tmp_path, max_steps=1, eval_strategy="steps", eval_steps=1)
    cache = str(tmp_path / "cache")
    config = CFG.replace(cuda_graphs=True)  # the fixed-shape steps CUDA runs
    trainer.add_callback(hf_blockdiff.BlockDiffusionEvalCallback(PROMPTS, config=config, compile_cache=cache,
                                                                 batch_size=2))
    trainer.add_callback(type("Step", (TrainerCallback,), {"on_step_begin": lambda *a, **k: events.append(
        ("step", getattr(model, "_blockdiff_engine", None) is None))})())
    trainer.train()
    trainer.evaluate()
    # a batch of 2 at train begin (compiling), saved, freed before the step; each evaluation decodes the 4 prompts
    assert events == [("load", cache), ("generate", 2, True, True), ("save", cache), ("step", True),
                      ("generate", 4, True, False), ("generate", 4, False, False)]
