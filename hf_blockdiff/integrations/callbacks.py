"""`BlockDiffusionEvalCallback`: block-diffusion generation on eval prompts at every `Trainer.evaluate`
(docs/architecture.md, "Around the loop")."""

from __future__ import annotations

import logging
from typing import Callable

from transformers import TrainerCallback

from ..config import BlockDiffusionConfig
from ..patching import free_cache
from . import compile_cache as compile_caches
from .distributed import generate_distributed

logger = logging.getLogger(__name__)

PREFIX = "eval_blockdiff_"


def exact_match(completions: list, references: list) -> dict[str, float]:
    """Share of completions equal to their reference (texts stripped; token-id lists compared as they are)."""
    def norm(x):
        return x.strip() if isinstance(x, str) else list(x)

    hits = sum(norm(c) == norm(r) for c, r in zip(completions, references, strict=True))
    return {"accuracy": hits / max(len(references), 1)}


class BlockDiffusionEvalCallback(TrainerCallback):
    """Generates for `prompts` with `generate_multi_block` after the Trainer's evaluation and logs `eval_blockdiff_*`.

    prompts: strings (decoded with `tokenizer`, else the Trainer's processing class), token-id lists, or chat
    messages with `chat=True`. The prompts are split over the processes (accelerate) and gathered back in order.
    scorer(completions, references) -> float | dict[str, float]: completions are texts when there is a tokenizer,
    else token-id lists; a float is logged as `eval_blockdiff_score`, a dict key by key. Default: exact match
    against `references` (`eval_blockdiff_accuracy`). A scorer that raises is reported as a warning; training goes on.
    Also logged: num_forwards (batched forwards of the generation), tokens_per_forward (tokens committed per decoding
    step of a prompt, as `BlockDiffusionOutput.tokens_per_forward`, whatever the batch size) and tok_s.
    every_n_evals: generate at the first evaluation and every n-th after it.
    compile_cache: a directory of torch.compile artifacts (`hf-blockdiff warmup`, integrations/compile_cache.py):
    loaded when training begins, then warmed there: a first batch of prompts per process is decoded (reading what an
    earlier run compiled, compiling the rest), what it compiled is saved for the next run, and its memory is freed
    before the first training step. The first evaluation then compiles nothing, and its tok_s times decoding alone.

    The metrics join the dict `Trainer.evaluate` returns (so `metric_for_best_model="eval_blockdiff_accuracy"` works)
    and `trainer.state.log_history`. Pass `trainer=` to log them through `trainer.log`, which also reaches the
    reporting integrations (wandb, tensorboard, ...). The model's weights, gradients, requires_grad flags and
    train/eval mode are as before the generation (a PEFT model generates with its adapters merged, then restored).
    """

    def __init__(self, prompts: list, references: list | None = None, config: BlockDiffusionConfig | None = None,
                 scorer: Callable | None = None, every_n_evals: int = 1, tokenizer=None, batch_size: int = 16,
                 chat: bool = False, trainer=None, compile_cache: str | None = None):
        if references is not None and len(references) != len(prompts):
            raise ValueError(f"references has {len(references)} entries for {len(prompts)} prompts.")
        if not isinstance(every_n_evals, int) or every_n_evals < 1:
            raise ValueError(f"every_n_evals={every_n_evals!r}: pass a positive integer.")
        self.prompts, self.references, self.config = list(prompts), references, config
        self.scorer = scorer if scorer is not None else (exact_match if references is not None else None)
        self.every_n_evals, self.tokenizer, self.batch_size, self.chat = every_n_evals, tokenizer, batch_size, chat
        self.trainer, self.compile_cache = trainer, compile_cache
        self.evaluations = self.generations = 0

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        """With a compile cache: load it and warm (the class docstring); the engine is freed, so the KV pool of the
        first evaluation is sized by the memory left once the optimizer's state exists."""
        if self.compile_cache is None or model is None:
            return
        compile_caches.load(model, self.compile_cache)
        first_batches = self.prompts[: self.batch_size * args.world_size]  # one batch a process
        self._generate(model, first_batches, processing_class, state)
        free_cache(model)

    def on_evaluate(self, args, state, control, model=None, metrics=None, processing_class=None, **kwargs):
        self.evaluations += 1
        if (self.evaluations - 1) % self.every_n_evals:
            return
        results = self._generate(model, self.prompts, processing_class, state)
        logs = {
            "num_forwards": results.num_forwards,
            "tokens_per_forward": results.tokens_per_forward,
            "tok_s": results.tokens_per_second,
            **self._scores([c.text if c.text is not None else c.token_ids for c in results]),
        }
        logs = {PREFIX + name: value for name, value in logs.items()}
        if metrics is not None:
            metrics.update(logs)
        if self.trainer is not None:
            self.trainer.log(logs)
        else:  # the entry trainer.log would have written
            entry = {**logs, "step": state.global_step}
            if state.epoch is not None:
                entry["epoch"] = state.epoch
            state.log_history.append(entry)

    def _generate(self, model, prompts: list, processing_class, state):
        """`generate_distributed` with the modules' train/eval flags restored after; the first generation of the run
        saves the compile cache (one process writes it)."""
        modes = {module: module.training for module in model.modules()}
        try:
            results = generate_distributed(model, prompts, self.config, self.tokenizer or processing_class,
                                           batch_size=self.batch_size, chat=self.chat)
        finally:
            for module, training in modes.items():
                module.training = training
        self.generations += 1
        if self.compile_cache is not None and self.generations == 1 and state.is_world_process_zero:
            compile_caches.save(model, self.compile_cache)
        return results

    def _scores(self, completions: list) -> dict[str, float]:
        if self.scorer is None:
            return {}
        try:
            scores = self.scorer(completions, self.references)
            return {k: float(v) for k, v in scores.items()} if isinstance(scores, dict) else {"score": float(scores)}
        except Exception as error:  # a broken metric must not end a training run
            logger.warning("BlockDiffusionEvalCallback: the scorer raised %s: %s; logging the generation metrics "
                           "without scores, training goes on.", type(error).__name__, error)
            return {}
