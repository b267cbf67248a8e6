"""What a step commits: the scores of its positions (`scoring`) and the remasking strategies that turn them into a
transfer mask (`remasking`). Pure functions of tensors: no model, no transformers (docs/architecture.md, "Scoring
and strategies")."""

from .remasking import (
    STRATEGIES, BlockScores, Strategy, StrategyParams, dream_count, entropy_bound_accept, register_strategy,
    select_edits, select_remasks, strategy_names,
)

__all__ = ["STRATEGIES", "BlockScores", "Strategy", "StrategyParams", "dream_count", "entropy_bound_accept",
           "register_strategy", "select_edits", "select_remasks", "strategy_names"]
