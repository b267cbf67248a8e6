"""Remasking strategies (DESIGN §5): pure, batched functions from block scores to a transfer mask.

Every strategy sees the active blocks of a step as rows of `BlockScores` ([NB, L] tensors, one row per block) and
returns a bool [NB, L] mask of positions to commit, always a subset of `masked`. A block marked `forced` must make
progress as its rule says (schedule count, fallback, forced token); other blocks only take positions that pass the
strategy's threshold (multi-block decoding, DESIGN §3.4). Ties between positions go to the lowest position.
No strategy synchronizes with the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class BlockScores:
    masked: torch.Tensor  # [NB, L] bool: undecided positions
    confidence: torch.Tensor  # [NB, L] float: probability of the proposal
    entropy: torch.Tensor  # [NB, L] float
    margin: torch.Tensor  # [NB, L] float: top-1 minus top-2 probability
    scheduled: torch.Tensor  # [NB] long: n_t, tokens the schedule asks for this step
    forced: torch.Tensor  # [NB] bool: the block must make progress this step


@dataclass(frozen=True)
class StrategyParams:
    threshold: float
    fallback: str = "topk"


@dataclass(frozen=True)
class Strategy:
    name: str
    select: Callable[[BlockScores, StrategyParams], torch.Tensor]
    default_threshold: float = 0.9
    threshold_range: tuple[float, float] = (0.0, 1.0)


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy) -> Strategy:
    STRATEGIES[strategy.name] = strategy
    return strategy


def strategy_names() -> tuple[str, ...]:
    return tuple(sorted(STRATEGIES))


def select_smallest(key: torch.Tensor, masked: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
    """The `count` masked positions of each row with the smallest key (ties → lowest position)."""
    order = torch.sort(key.masked_fill(~masked, float("inf")), dim=-1, stable=True).indices
    positions = torch.arange(key.shape[-1], device=key.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, positions)
    count = count[:, None] if isinstance(count, torch.Tensor) else count
    return masked & (rank < count)


def _position_key(scores: BlockScores) -> torch.Tensor:
    return torch.arange(scores.masked.shape[-1], device=scores.masked.device, dtype=torch.float32).expand(
        scores.masked.shape
    )


def _forced_only(scores: BlockScores, chosen: torch.Tensor) -> torch.Tensor:
    return chosen & scores.forced[:, None]


def _sequential(s: BlockScores, p: StrategyParams) -> torch.Tensor:
    return _forced_only(s, select_smallest(_position_key(s), s.masked, s.scheduled))


def _low_confidence_static(s: BlockScores, p: StrategyParams) -> torch.Tensor:
    return _forced_only(s, select_smallest(-s.confidence, s.masked, s.scheduled))


def _low_confidence_dynamic(s: BlockScores, p: StrategyParams) -> torch.Tensor:
    passing = s.masked & (s.confidence > p.threshold)
    fallback_key = -s.confidence if p.fallback == "topk" else _position_key(s)
    short = s.forced & (passing.sum(-1) < s.scheduled)
    return torch.where(short[:, None], select_smallest(fallback_key, s.masked, s.scheduled), passing)


def _confidence_threshold(s: BlockScores, p: StrategyParams) -> torch.Tensor:
    passing = s.masked & (s.confidence >= p.threshold)
    return passing | _forced_only(s, select_smallest(-s.confidence, s.masked, 1))


def _entropy_threshold(s: BlockScores, p: StrategyParams) -> torch.Tensor:
    passing = s.masked & (s.entropy < p.threshold)
    stalled = s.forced & ~passing.any(-1)
    return passing | (select_smallest(s.entropy, s.masked, 1) & stalled[:, None])


for _strategy in (
    Strategy("sequential", _sequential),
    Strategy("low_confidence_static", _low_confidence_static),
    Strategy("low_confidence_dynamic", _low_confidence_dynamic),
    Strategy("confidence_threshold", _confidence_threshold),
    Strategy("entropy_threshold", _entropy_threshold, default_threshold=0.5, threshold_range=(0.0, float("inf"))),
):
    register_strategy(_strategy)
