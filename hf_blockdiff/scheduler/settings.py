"""Each row's own decoding settings (docs/architecture.md, "Serving"): how many tokens it generates, how it samples and
its strategy threshold, kept per slot in fixed tensors of the decode state, so rows of one batch decode by their own
settings and a step sees no new shape when they change."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import BlockDiffusionConfig


@dataclass(frozen=True)
class SlotSettings:
    """One row's settings (an offline call gives every row its config's: `of`)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    threshold: float

    @classmethod
    def of(cls, cfg: BlockDiffusionConfig) -> "SlotSettings":
        return cls(cfg.max_new_tokens, cfg.temperature, cfg.top_p, cfg.top_k, cfg.effective_threshold)

    @property
    def sampling(self) -> tuple[float, int, float]:
        """(temperature, top-k, top-p) as they act: a greedy row filters nothing."""
        sampled = self.temperature > 0
        return (self.temperature, self.top_k if sampled and self.top_k > 0 else 0, self.top_p if sampled else 1.0)


def slot_values(settings: list[SlotSettings], device: torch.device) -> dict[str, torch.Tensor]:
    """The state's per-slot tensors of `settings`, named as `DecodeState`'s buffers. Floats are rounded to fp32
    from float64 on the host, as the scalar path's Python floats are where they meet fp32 tensors, so a row decodes
    by the same bits whichever path scores it."""

    def column(values, dtype):
        return torch.tensor(values, dtype=torch.float64 if dtype.is_floating_point else dtype).to(device, dtype)

    sampled = [s.temperature > 0 for s in settings]
    return {
        "max_new": column([s.max_new_tokens for s in settings], torch.long),
        "inverse_temperature": column([1.0 / s.temperature if on else 0.0 for s, on in zip(settings, sampled)],
                                      torch.float32),
        "top_k": column([s.top_k if on else 0 for s, on in zip(settings, sampled)], torch.long),
        "top_p_drop": column([1.0 - s.top_p if on else 0.0 for s, on in zip(settings, sampled)], torch.float32),
        "threshold": column([s.threshold for s in settings], torch.float32),
        "log_threshold": column([_log(s.threshold) for s in settings], torch.float32),
    }


def _log(threshold: float) -> float:
    """dynamic_pmax's log threshold, as `StrategyParams` computes it."""
    return torch.log(torch.tensor(threshold, dtype=torch.float64)).item() if threshold > 0 else -float("inf")
