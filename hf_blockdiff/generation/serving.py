"""What a live engine accepts (docs/architecture.md, "Serving"): its config and capacity, checked once, and each
submitted row's prompt and settings, checked in the caller's thread before anything is queued (a `ValueError` naming
the field and the fix)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..attention import AttentionBackend
from ..config import BlockDiffusionConfig
from ..config.checks import check_block_config, is_int, is_number
from ..config.profiles import model_profile
from ..scheduler.settings import SlotSettings
from ..strategies import STRATEGIES
from ..weights.tensor_parallel import sharded_decoding
from .hf_conventions import merged_config
from .inputs import check_call, check_lengths, decoding_backend


@dataclass(frozen=True)
class ServingLimits:
    """The engine's resolved config (its `max_new_tokens` the most a row may ask for), backend, device and
    capacity."""

    cfg: BlockDiffusionConfig
    backend: AttentionBackend
    device: torch.device
    slots: int
    max_prompt_tokens: int
    vocab: int | None

    @classmethod
    def of(cls, model, config, max_batch_size: int, max_prompt_tokens: int, max_new_tokens: int,
           keywords: dict) -> "ServingLimits":
        for name, value in (("max_batch_size", max_batch_size), ("max_prompt_tokens", max_prompt_tokens),
                            ("max_new_tokens", max_new_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LiveEngine {name}={value!r}: pass a positive integer.")
        config = merged_config(model, config, dict(keywords, max_new_tokens=max_new_tokens,
                                                   max_batch_size=max_batch_size))
        vocab = getattr(model.config, "vocab_size", None)
        check_block_config(config)
        cfg = config.resolved(model_profile(model), vocab)
        if cfg.pos_temp_slope:
            raise ValueError("LiveEngine pos_temp_slope: rows sample at their own temperatures, which the per-position "
                             "slope does not follow; leave pos_temp_slope at 0 to serve.")
        device = next(model.parameters()).device
        check_call(cfg, device, None, None)
        check_lengths(model, [torch.zeros(length, dtype=torch.long) for length in (1, max_prompt_tokens)], cfg)
        backend = decoding_backend(model, cfg, device)
        return cls(cfg, backend, device, max_batch_size, max_prompt_tokens, vocab)

    @contextmanager
    def decoding(self, model):
        """The model as a call decodes it (no autograd, eval mode, local tensor-parallel shards), put back after. The
        live engine enters this at every step: a model already in eval mode is left alone (setting every module's
        mode, twice a step, took milliseconds of the engine thread between an SDAR-4B's steps)."""
        was_training, switch = model.training, any(module.training for module in model.modules())
        if switch:
            model.eval()
        try:
            with torch.no_grad(), sharded_decoding(model):
                yield
        finally:
            if switch:
                model.train(was_training)


def check_prompt(prompt, limits: ServingLimits) -> torch.Tensor:
    """The prompt's ids as a CPU LongTensor (the engine thread moves it: a CUDA call from a caller's thread could
    land inside the engine's graph capture)."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    if isinstance(prompt, (str, bytes)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ValueError("prompt: pass a sequence of token ids (ints); encode text with the model's tokenizer.")
    if not 0 < len(prompt) <= limits.max_prompt_tokens:
        raise ValueError(f"prompt has {len(prompt)} tokens: pass 1 to max_prompt_tokens={limits.max_prompt_tokens}.")
    if limits.vocab is not None and not all(0 <= t < limits.vocab for t in prompt):
        raise ValueError(f"prompt holds ids outside the model's vocabulary [0, {limits.vocab}): encode it with the "
                         "model's own tokenizer.")
    return torch.tensor(prompt, dtype=torch.long)


def check_settings(settings, limits: ServingLimits) -> SlotSettings:
    """The row's `SlotSettings`: its own values, the engine config's where it leaves one None."""
    cfg = limits.cfg
    if not hasattr(settings, "max_new_tokens") or not hasattr(settings, "seed"):
        raise TypeError("settings must be a RowSettings.")
    _integer("max_new_tokens", settings.max_new_tokens, 1, cfg.max_new_tokens, "the engine's max_new_tokens")
    _integer("seed", settings.seed, 0, 2**32 - 1, "2**32 - 1 (row_seeds gives a request's seeds)")
    if settings.temperature is not None and not (_number(settings.temperature) and settings.temperature >= 0):
        raise ValueError(f"temperature={settings.temperature!r}: pass 0 for greedy decoding or a positive float.")
    if settings.top_p is not None and not (_number(settings.top_p) and 0 < settings.top_p <= 1):
        raise ValueError(f"top_p={settings.top_p!r}: pass a float in (0, 1] (1 disables top-p).")
    if settings.top_k is not None:
        _integer("top_k", settings.top_k, 0, math.inf, "any (0 disables top-k)")
    strategy = STRATEGIES[cfg.strategy]
    if settings.threshold is not None:
        low, high = strategy.threshold_range
        if not strategy.thresholded:
            raise ValueError(f"threshold={settings.threshold!r}: the engine's strategy {cfg.strategy!r} has no "
                             "threshold; leave it unset.")
        if not (_number(settings.threshold) and low <= settings.threshold <= high):
            raise ValueError(f"threshold={settings.threshold!r}: strategy {cfg.strategy!r} needs one in "
                             f"[{low}, {high}].")
    if not isinstance(settings.stop_strings, (tuple, list)) or not all(
            isinstance(s, str) and s for s in settings.stop_strings):
        raise ValueError(f"stop_strings={settings.stop_strings!r}: pass a tuple of non-empty strings.")
    if not isinstance(settings.drafts, bool):
        raise ValueError(f"drafts={settings.drafts!r}: pass True or False.")

    def given(value, default):
        return default if value is None else value

    return SlotSettings(settings.max_new_tokens, float(given(settings.temperature, cfg.temperature)),
                        float(given(settings.top_p, cfg.top_p)), int(given(settings.top_k, cfg.top_k)),
                        float(given(settings.threshold, cfg.effective_threshold)))


def _number(value) -> bool:
    return is_number(value) and math.isfinite(value)


def _integer(name: str, value, low, high, high_name: str) -> None:
    if not is_int(value) or not low <= value <= high:
        raise ValueError(f"{name}={value!r}: pass an integer from {low} to {high_name}.")
