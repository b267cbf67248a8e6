"""One step's decision: hidden states of the active blocks → logits → scores → strategy → canvas.

Only masked positions of active blocks reach the LM head (selective logits). Everything is batched over the
active blocks of all rows; a row's randomness depends only on its own seed and counters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import BlockDiffusionConfig
from ..kernels.rng import uniform_noise
from ..scoring import SamplingParams, Scores, score_logits
from ..strategies import STRATEGIES, BlockScores, StrategyParams
from .state import BlockStatus, DecodeState


@dataclass
class ActiveBlocks:
    """The blocks a step decides, one row each ([NB] / [NB, B])."""

    rows: torch.Tensor  # canvas row of each block
    window_rows: torch.Tensor  # its row in the forward's batch
    blocks: torch.Tensor  # decode-block index
    positions: torch.Tensor  # [NB, B] canvas positions
    candidates: torch.Tensor  # [NB, B] masked positions the strategy may commit


class Decider:
    def __init__(self, cfg: BlockDiffusionConfig, lm_head: torch.nn.Module, seeds: torch.Tensor):
        self.cfg, self.lm_head, self.seeds = cfg, lm_head, seeds
        self.strategy = STRATEGIES[cfg.strategy]
        self.params = StrategyParams(
            threshold=cfg.effective_threshold, fallback=cfg.fallback, strict=cfg.strict_threshold,
            entropy_budget=cfg.entropy_budget, relative_alpha=cfg.relative_alpha, factor=cfg.factor,
            steps=cfg.steps_per_block, dream_eps=cfg.dream_eps,
        )
        self.sampling = SamplingParams(cfg.mask_token_id, cfg.temperature, cfg.top_k, cfg.top_p, cfg.confidence,
                                       cfg.score_precision)

    def active_blocks(self, state: DecodeState, status: BlockStatus, rows: torch.Tensor,
                      active: torch.Tensor) -> ActiveBlocks:
        window_rows, blocks = torch.nonzero(active, as_tuple=True)
        block_rows = rows[window_rows]
        candidates = status.masked[block_rows, blocks]
        sub = self.cfg.sub_block_size
        if sub:  # only the first sub-block that still has masks
            has_mask = candidates.view(len(blocks), candidates.shape[1] // sub, sub).any(-1)
            first = has_mask.int().argmax(-1)
            in_first = torch.arange(candidates.shape[1], device=rows.device)[None] // sub == first[:, None]
            candidates = candidates & in_first
        return ActiveBlocks(block_rows, window_rows, blocks, state.geometry.positions[block_rows, blocks], candidates)

    def decide(self, state: DecodeState, status: BlockStatus, active: ActiveBlocks, hidden: torch.Tensor,
               hidden_uncond: torch.Tensor | None, forward_index: int) -> None:
        """Commit what the strategy picks among `active.candidates`; `hidden` ([NB, B, H]) predicts each slot."""
        pick = torch.nonzero(active.candidates, as_tuple=True)
        rows, positions = active.rows[pick[0]], active.positions[pick]
        logits = self.logits(state, rows, hidden[pick], None if hidden_uncond is None else hidden_uncond[pick])
        scores = self.score(state, rows, positions, pick[1], logits)
        transfer = self.select(state, status, active, pick, scores, logits)
        state.previous[rows, positions] = scores.proposal
        chosen = transfer[pick]
        state.commit(rows[chosen], positions[chosen], scores.proposal[chosen], scores.logprob[chosen].float(),
                     scores.entropy[chosen].float(), forward_index)
        stepped = torch.zeros(state.num_rows, dtype=torch.bool, device=rows.device)
        stepped[active.rows] = True
        state.draws += stepped.long()

    def logits(self, state: DecodeState, rows: torch.Tensor, hidden: torch.Tensor,
               hidden_uncond: torch.Tensor | None) -> torch.Tensor:
        """LM head on gathered hidden states, then guidance and the logits processors ([n, V] float)."""
        cfg = self.cfg
        logits = self.lm_head(hidden).float()
        if hidden_uncond is not None:
            uncond = self.lm_head(hidden_uncond).float()
            logits = uncond + (cfg.cfg_scale + 1) * (logits - uncond)
        if cfg.repetition_penalty != 1.0:
            present = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, state.canvas[rows], True)
            present[:, cfg.mask_token_id] = False
            penalty = cfg.repetition_penalty
            logits = torch.where(present, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        if cfg.logits_processor is not None:
            logits = cfg.logits_processor(state.canvas[rows], logits)
        return logits

    def score(self, state: DecodeState, rows: torch.Tensor, positions: torch.Tensor, offsets: torch.Tensor,
              logits: torch.Tensor) -> Scores:
        """Scores of positions at canvas `positions` of `rows`, `offsets` inside their block ([n] each)."""
        temperature = None
        if self.cfg.pos_temp_slope and self.cfg.temperature > 0:
            span = max(self.cfg.block_size - 1, 1)
            temperature = self.cfg.temperature * (1 + self.cfg.pos_temp_slope * offsets.float() / span)
        return score_logits(logits, self.sampling, self.seeds[rows], self.counter(state, rows, positions), temperature)

    @staticmethod
    def counter(state: DecodeState, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Noise counter of (row, position) at this step: unique per position and per step of the row."""
        return positions * 65599 + state.draws[rows]

    def select(self, state: DecodeState, status: BlockStatus, active: ActiveBlocks,
               pick: tuple[torch.Tensor, torch.Tensor], scores: Scores, logits: torch.Tensor) -> torch.Tensor:
        """The strategy's transfer mask over the active blocks ([NB, B])."""
        candidates = active.candidates

        def grid(values: torch.Tensor, fill) -> torch.Tensor:
            out = torch.full(candidates.shape, fill, dtype=values.dtype, device=values.device)
            out[pick] = values
            return out

        forced = self.forced(state, active)
        rows, blocks, positions = active.rows, active.blocks, active.positions
        block_scores = BlockScores(
            masked=candidates,
            confidence=grid(scores.confidence.float(), 0.0),
            entropy=grid(scores.entropy.float(), float("inf")),
            margin=grid(scores.margin.float(), 0.0),
            scheduled=state.schedule(rows, blocks, status.remaining[rows, blocks]),
            forced=forced,
            step=state.forced_steps[rows, blocks],
            proposal=grid(scores.proposal, -1),
        )
        needs = self.strategy.needs
        if "previous" in needs:
            block_scores.previous = state.previous[rows[:, None], positions.clamp(max=state.canvas.shape[1] - 1)]
        if "salience" in needs:
            salience = (logits.max(-1).values - logits.mean(-1)) / logits.std(-1).clamp_min(1e-12)
            block_scores.salience = grid(salience, float("-inf"))
        if "noise" in needs:
            counter = self.counter(state, rows[:, None].expand_as(positions), positions)
            seeds = self.seeds[rows][:, None].expand_as(positions)
            block_scores.noise = uniform_noise(seeds.reshape(-1), counter.reshape(-1), 1).view(positions.shape)
        state.forced_steps[rows[forced], blocks[forced]] += 1
        return self.strategy.select(block_scores, self.params) & candidates

    @staticmethod
    def forced(state: DecodeState, active: ActiveBlocks) -> torch.Tensor:
        """The lowest fully-activated block of each row among the active ones must make progress."""
        full = state.full[active.rows, active.blocks]
        never = torch.iinfo(torch.long).max
        lowest = torch.full((state.num_rows,), never, device=active.blocks.device)
        lowest = lowest.scatter_reduce(0, active.rows, torch.where(full, active.blocks, never), reduce="amin")
        return full & (active.blocks == lowest[active.rows])
