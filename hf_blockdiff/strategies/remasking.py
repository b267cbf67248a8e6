"""Remasking strategies (docs/architecture.md, "Scoring and strategies"): pure, batched functions from block scores to a
transfer mask.

Every strategy sees the active blocks of a step as rows of `BlockScores` ([NB, L] tensors, one row per block) and
returns a bool [NB, L] mask of positions to commit, always a subset of `masked`. A block marked `forced` must make
progress as its rule says (schedule count, fallback, forced token); other blocks only take the positions that pass
the strategy's own test, except the slot-wide forced token of `forced_token_scope="all_active"` (multi-block
decoding: docs/architecture.md, "The decode loop"). Rows come grouped by slot (`slot_blocks` per slot, in block order).
Ties between positions go to the lowest position. No strategy synchronizes with the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

INF = float("inf")


@dataclass
class BlockScores:
    masked: torch.Tensor  # [NB, L] bool: undecided positions that may be committed this step
    confidence: torch.Tensor  # [NB, L] float: probability of the proposal
    entropy: torch.Tensor  # [NB, L] float
    margin: torch.Tensor  # [NB, L] float: top-1 minus top-2 probability
    scheduled: torch.Tensor  # [NB] long: n_t, tokens the schedule asks for this step
    forced: torch.Tensor  # [NB] bool: the block must make progress this step
    step: torch.Tensor  # [NB] long: how many forced steps the block has had before this one
    proposal: torch.Tensor | None = None  # [NB, L] long
    previous: torch.Tensor | None = None  # [NB, L] long: last step's proposal (-1: none)
    salience: torch.Tensor | None = None  # [NB, L] float: (max ℓ - mean ℓ) / std ℓ
    noise: torch.Tensor | None = None  # [NB, L] float: uniform in (0, 1), seeded per row
    slot_blocks: int = 1  # rows come in groups of this many: one slot's active blocks, in block order
    editable: torch.Tensor | None = None  # [NB, L] bool: decided positions an edit may replace (editing only)
    current: torch.Tensor | None = None  # [NB, L] long: the canvas's tokens there
    final: torch.Tensor | None = None  # [NB] bool: the block's last allowed step (editing only)
    threshold: torch.Tensor | None = None  # [NB, 1] each row's own threshold (per-row settings); None: the params'
    log_threshold: torch.Tensor | None = None  # [NB, 1] its log, for dynamic_pmax


@dataclass(frozen=True)
class StrategyParams:
    threshold: float
    fallback: str = "topk"
    strict: bool = True
    entropy_budget: float = 1.0
    relative_alpha: float = 0.9
    factor: float = 1.0
    steps: int = 1
    dream_eps: float = 1e-3
    forced_token_scope: str = "lowest_full_block"
    editing_threshold: float | None = None
    remask_threshold: float | None = None
    log_threshold: float = field(init=False)  # dynamic_pmax's, on the host once (not a host sync in every step)

    def __post_init__(self):
        log = torch.log(torch.tensor(self.threshold, dtype=torch.float64)).item() if self.threshold > 0 else -INF
        object.__setattr__(self, "log_threshold", log)


@dataclass(frozen=True)
class Strategy:
    name: str
    select: Callable[[BlockScores, StrategyParams], torch.Tensor]
    default_threshold: float = 0.9
    threshold_range: tuple[float, float] = (0.0, 1.0)
    strict: bool = True  # default comparison with the threshold
    needs: frozenset = frozenset()  # optional BlockScores fields it reads
    forced_top1: bool = False  # forced blocks take their best candidate when none passes (forced_token_scope)
    thresholded: bool = False  # reads the threshold (a row's own threshold means something only then)


STRATEGIES: dict[str, Strategy] = {}


def register_strategy(strategy: Strategy) -> Strategy:
    STRATEGIES[strategy.name] = strategy
    return strategy


def strategy_names() -> tuple[str, ...]:
    return tuple(sorted(STRATEGIES))


def select_edits(s: BlockScores, p: StrategyParams) -> torch.Tensor:
    """Token-to-token edits (LLaDA2.1, diffusers' BlockRefinementScheduler; Diffulex's edit sampler): the editable
    positions whose proposal differs from their token with confidence > `editing_threshold`, unless remasked.
    Independent of the strategy, which commits masked positions only."""
    return s.editable & (s.proposal != s.current) & (s.confidence > p.editing_threshold) & ~select_remasks(s, p)


def select_remasks(s: BlockScores, p: StrategyParams) -> torch.Tensor:
    """Diffulex's DMax remasking: the editable positions whose proposal has confidence < `remask_threshold` turn
    back into masks, except at the block's last allowed step (none when the threshold is None)."""
    if p.remask_threshold is None:
        return torch.zeros_like(s.editable)
    return s.editable & (s.confidence < p.remask_threshold) & ~s.final[:, None]


# -- building blocks ------------------------------------------------------------------------------------------------


def select_smallest(key: torch.Tensor, masked: torch.Tensor, count: torch.Tensor | int) -> torch.Tensor:
    """The `count` masked positions of each row with the smallest key (ties → lowest position)."""
    order = torch.sort(key.masked_fill(~masked, INF), dim=-1, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, _positions(key).expand_as(order))
    count = count[:, None] if isinstance(count, torch.Tensor) else count
    return masked & (rank < count)


def prefix_of_sorted(key: torch.Tensor, masked: torch.Tensor, keep: Callable[[torch.Tensor], torch.Tensor]):
    """Sort each row's masked positions by `key` (ascending, stable) and take the longest prefix whose sorted values
    `keep` accepts position by position (keep gets the sorted values, non-masked ones at +inf); returns the mask and
    the prefix length."""
    sorted_key, order = torch.sort(key.masked_fill(~masked, INF), dim=-1, stable=True)
    accepted = (keep(sorted_key) & torch.isfinite(sorted_key)).long().cumprod(-1)
    length = accepted.sum(-1)
    rank = torch.empty_like(order).scatter_(-1, order, _positions(key).expand_as(order))
    return masked & (rank < length[:, None]), length


def _positions(key: torch.Tensor) -> torch.Tensor:
    return torch.arange(key.shape[-1], device=key.device)


def _position_key(s: BlockScores) -> torch.Tensor:
    return _positions(s.masked).to(torch.float32).expand(s.masked.shape)


def _above(value: torch.Tensor, threshold: float | torch.Tensor, strict: bool) -> torch.Tensor:
    return value > threshold if strict else value >= threshold


def _threshold(s: BlockScores, p: StrategyParams) -> float | torch.Tensor:
    """The threshold of each row: its own where the scheduler gives them (fp32, as the params' float compares)."""
    return p.threshold if s.threshold is None else s.threshold


def _log_threshold(s: BlockScores, p: StrategyParams) -> float | torch.Tensor:
    return p.log_threshold if s.log_threshold is None else s.log_threshold


def _forced_only(s: BlockScores, chosen: torch.Tensor) -> torch.Tensor:
    return chosen & s.forced[:, None]


def _with_forced_top1(s: BlockScores, p: StrategyParams, passing: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """`passing`, plus the smallest-key masked position of forced blocks where nothing passed; with
    `forced_token_scope="all_active"` also the smallest-key masked position over all of a slot's active blocks
    where nothing passed in any of them (d3LLM's LLaDA decoder; docs/architecture.md, "The decode loop")."""
    stalled = s.forced & ~passing.any(-1)
    chosen = passing | (select_smallest(key, s.masked, 1) & stalled[:, None])
    if p.forced_token_scope == "all_active":
        slot = (-1, s.slot_blocks * s.masked.shape[-1])  # a slot's rows side by side: canvas order
        slot_stalled = ~passing.reshape(slot).any(-1)
        slot_top1 = select_smallest(key.reshape(slot), s.masked.reshape(slot), 1) & slot_stalled[:, None]
        chosen = chosen | slot_top1.view_as(chosen)
    return chosen


# -- fixed-count strategies -----------------------------------------------------------------------------------------


def _sequential(s, p):
    return _forced_only(s, select_smallest(_position_key(s), s.masked, s.scheduled))


def _anti_sequential(s, p):
    return _forced_only(s, select_smallest(-_position_key(s), s.masked, s.scheduled))


def _low_confidence_static(s, p):
    return _forced_only(s, select_smallest(-s.confidence, s.masked, s.scheduled))


def _random(s, p):
    return _forced_only(s, select_smallest(s.noise, s.masked, s.scheduled))


def _least_entropy(s, p):
    return _forced_only(s, select_smallest(s.entropy, s.masked, s.scheduled))


def _top2_margin(s, p):
    return _forced_only(s, select_smallest(-s.margin, s.masked, s.scheduled))


# -- threshold strategies -------------------------------------------------------------------------------------------


def _low_confidence_dynamic(s, p):
    passing = s.masked & _above(s.confidence, _threshold(s, p), p.strict)
    fallback_key = -s.confidence if p.fallback == "topk" else _position_key(s)
    short = s.forced & (passing.sum(-1) < s.scheduled)
    return torch.where(short[:, None], select_smallest(fallback_key, s.masked, s.scheduled), passing)


def _confidence_threshold(s, p):
    passing = s.masked & _above(s.confidence, _threshold(s, p), p.strict)
    return passing | _forced_only(s, select_smallest(-s.confidence, s.masked, 1))


def _confidence_factor(s, p):
    """Fast-dLLM v1's factor rule: the longest prefix (by confidence, descending) with c_(r) ≥ 1 − f/(r + 1)."""
    rank = _positions(s.masked) + 1

    def keep(sorted_negative_confidence):
        return (-sorted_negative_confidence >= 1 - p.factor / (rank + 1)) | (rank == 1)

    chosen, length = prefix_of_sorted(-s.confidence, s.masked, keep)
    only_last_failed = length == s.masked.sum(-1) - 1  # Fast-dLLM takes the last one too in that case
    return torch.where(only_last_failed[:, None], s.masked, chosen)


def _entropy_threshold(s, p):
    passing = s.masked & (s.entropy < _threshold(s, p) if p.strict else s.entropy <= _threshold(s, p))
    return _with_forced_top1(s, p, passing, s.entropy)


def _entropy_bounded(s, p):
    chosen, _ = prefix_of_sorted(s.entropy, s.masked, lambda h: h.cumsum(-1) < p.entropy_budget)
    return _with_forced_top1(s, p, chosen, s.entropy)


def _dynamic_pmax(s, p):
    chosen, _ = prefix_of_sorted(
        -s.confidence, s.masked, lambda neg_c: torch.log(-neg_c).cumsum(-1) >= _log_threshold(s, p)
    )
    return _with_forced_top1(s, p, chosen, -s.confidence)


def _causal_waterfall(s, p):
    """The longest run of masked positions, from the first one, whose confidences all pass."""
    passing = ~s.masked | _above(s.confidence, _threshold(s, p), p.strict)
    run = s.masked & passing.long().cumprod(-1).bool()
    return _with_forced_top1(s, p, run, _position_key(s))


def _relative_top(s, p):
    best = s.confidence.masked_fill(~s.masked, -INF).max(-1, keepdim=True).values
    passing = s.masked & (s.confidence >= p.relative_alpha * best)
    return _with_forced_top1(s, p, passing, -s.confidence)


def _consensus_commit(s, p):
    agree = (s.proposal == s.previous) & _above(s.confidence, _threshold(s, p), p.strict)
    return _with_forced_top1(s, p, s.masked & agree, -s.confidence)


def _logit_salience(s, p):
    passing = s.masked & _above(s.salience, _threshold(s, p), p.strict)
    return _with_forced_top1(s, p, passing, -s.salience)


# -- Dream's global schedule ----------------------------------------------------------------------------------------


def dream_count(s: BlockScores, p: StrategyParams) -> torch.Tensor:
    """Dream: n = ⌊M·(1 − s/t)⌋ with t, s consecutive points of linspace(1, eps, steps + 1) and M the masks left;
    the last step (and any later one) commits everything."""
    remaining = s.masked.sum(-1)
    t = 1 - (1 - p.dream_eps) * s.step / p.steps
    t_next = 1 - (1 - p.dream_eps) * (s.step + 1) / p.steps
    count = torch.floor(remaining * (1 - t_next / t)).long()
    return torch.where(s.step >= p.steps - 1, remaining, count)


def _dream(score: Callable[[BlockScores], torch.Tensor]):
    def select(s, p):
        return _forced_only(s, select_smallest(-score(s), s.masked, dream_count(s, p)))

    return select


def _register_all() -> None:
    """Every strategy by name; their rules and where they come from: docs/architecture.md, "Scoring and strategies"."""
    entropy_range, top1, gated = (0.0, INF), dict(forced_top1=True), dict(thresholded=True)
    for strategy in (
        Strategy("sequential", _sequential),
        Strategy("anti_sequential", _anti_sequential),
        Strategy("low_confidence_static", _low_confidence_static),
        Strategy("random", _random, needs=frozenset({"noise"})),
        Strategy("least_entropy", _least_entropy),
        Strategy("top2_margin", _top2_margin),
        Strategy("low_confidence_dynamic", _low_confidence_dynamic, **gated),
        Strategy("confidence_threshold", _confidence_threshold, strict=False, **gated),
        Strategy("confidence_factor", _confidence_factor),
        Strategy("entropy_threshold", _entropy_threshold, default_threshold=0.5, threshold_range=entropy_range,
                 **top1, **gated),
        Strategy("entropy_bounded", _entropy_bounded, **top1),
        Strategy("dynamic_pmax", _dynamic_pmax, strict=False, **top1, **gated),
        Strategy("causal_waterfall", _causal_waterfall, **top1, **gated),
        Strategy("relative_top", _relative_top, **top1),
        Strategy("consensus_commit", _consensus_commit, needs=frozenset({"previous"}), **top1, **gated),
        Strategy("logit_salience", _logit_salience, default_threshold=8.0, threshold_range=entropy_range,
                 needs=frozenset({"salience"}), **top1, **gated),
        Strategy("maskgit_plus", _dream(lambda s: s.confidence)),
        Strategy("topk_margin", _dream(lambda s: s.margin)),
        Strategy("entropy", _dream(lambda s: -s.entropy)),
    ):
        register_strategy(strategy)


_register_all()


def entropy_bound_accept(entropy: torch.Tensor, bound: float) -> torch.Tensor:
    """DiffusionGemma's entropy-bound acceptance (docs/fidelity.md, "DiffusionGemma"): per row of `entropy` [S, L],
    the positions of the lowest entropies whose sum minus the largest of them is ≤ `bound` (the lowest is always
    taken). Every canvas position is a candidate at every step; sorting as transformers does keeps its tie order."""
    ordered, order = torch.sort(entropy, dim=-1, descending=False)
    taken = ordered.cumsum(-1) - ordered <= bound
    return torch.zeros_like(taken).scatter(-1, order, taken)
