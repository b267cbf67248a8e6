"""One step's decision: hidden states → logits → scores → strategy → canvas, on fixed shapes.

The active blocks of every slot are laid out as `[slots, K, B]` (K = max active blocks). The LM head runs on the
undecided positions of active blocks only, gathered into `capacity` rows (all of them when `capacity` is None, a
fixed count inside a CUDA graph). A slot's randomness depends only on its own seed and counters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import BlockDiffusionConfig
from ..kernels.rng import uniform_noise
from ..scoring import SamplingParams, Scores, score_logits
from ..strategies import STRATEGIES, BlockScores, StrategyParams
from .state import BlockStatus, DecodeState


@dataclass
class ActiveBlocks:
    """Each slot's active blocks in order, [R, K] (`valid` False past the last one), and their positions."""

    blocks: torch.Tensor  # [R, K] decode-block index (clamped)
    valid: torch.Tensor  # [R, K]
    positions: torch.Tensor  # [R, K, B]
    candidates: torch.Tensor  # [R, K, B] undecided positions the strategy may commit

    @property
    def rows(self) -> torch.Tensor:
        return torch.arange(self.blocks.shape[0], device=self.blocks.device)[:, None].expand_as(self.blocks)


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

    def active_blocks(self, state: DecodeState, status: BlockStatus, active: torch.Tensor, k: int) -> ActiveBlocks:
        never = active.shape[1]
        blocks = torch.sort(torch.where(active, state.block_index, never), dim=1).values[:, :k]
        valid = blocks < never
        blocks = blocks.clamp(max=never - 1)
        rows = torch.arange(len(blocks), device=blocks.device)[:, None]
        candidates = status.masked[rows, blocks] & valid[..., None]
        sub = self.cfg.sub_block_size
        if sub:  # only the first sub-block that still has masks
            shape = candidates.shape
            has_mask = candidates.view(*shape[:2], shape[2] // sub, sub).any(-1)
            first = has_mask.int().argmax(-1, keepdim=True)
            in_first = torch.arange(shape[2], device=blocks.device) // sub == first
            candidates = candidates & in_first
        return ActiveBlocks(blocks, valid, state.positions[rows, blocks], candidates)

    def decide(self, state: DecodeState, status: BlockStatus, active: ActiveBlocks,
               hidden_at: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]],
               capacity: int | None) -> None:
        """Commit what the strategy picks among `active.candidates`; `hidden_at(rows, positions)` gives the hidden
        states (and unconditional ones with guidance) that predict those positions."""
        rows_all, positions_all = active.rows[..., None].expand_as(active.positions), active.positions
        flat = active.candidates.reshape(-1)
        if capacity is None:
            pick = torch.nonzero(flat).flatten()
        else:
            pick = torch.sort((~flat).to(torch.int8), stable=True).indices[:capacity]
        picked = flat[pick]
        rows, positions = rows_all.reshape(-1)[pick], positions_all.reshape(-1)[pick]
        hidden, hidden_uncond = hidden_at(rows, positions)
        logits = self.logits(state, rows, hidden, hidden_uncond)
        offsets = pick % active.positions.shape[-1]
        scores = self.score(state, rows, positions, offsets, logits)
        shape = active.candidates.shape
        target = torch.where(picked, pick, flat.numel())  # padding rows land past the end

        def grid(values: torch.Tensor, fill) -> torch.Tensor:
            out = torch.full((flat.numel() + 1,), fill, dtype=values.dtype, device=values.device)
            out[target] = values
            return out[:-1].view(shape)

        transfer = self.select(state, status, active, grid, scores, logits)
        state.previous[rows, torch.where(picked, positions, state.width)] = scores.proposal
        state.commit(rows_all, positions_all, grid(scores.proposal, 0), grid(scores.logprob.float(), 0.0),
                     grid(scores.entropy.float(), 0.0), transfer)
        state.draws += active.valid.any(-1).long()

    def logits(self, state: DecodeState, rows: torch.Tensor, hidden: torch.Tensor,
               hidden_uncond: torch.Tensor | None) -> torch.Tensor:
        """LM head on gathered hidden states, then guidance and the logits processors ([n, V]; the model's dtype
        unless a processor needs float32: the fused scoring reads bf16 logits as they are)."""
        cfg = self.cfg
        logits = self.lm_head(hidden)
        if hidden_uncond is not None:
            uncond = self.lm_head(hidden_uncond).float()
            logits = uncond + (cfg.cfg_scale + 1) * (logits.float() - uncond)
        if cfg.repetition_penalty != 1.0:
            logits = logits.float()
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
        """Noise counter of (slot, position) at this step: unique per position and per step of the slot."""
        return positions * 65599 + state.draws[rows]

    def select(self, state: DecodeState, status: BlockStatus, active: ActiveBlocks,
               grid: Callable[[torch.Tensor, object], torch.Tensor], scores: Scores, logits: torch.Tensor):
        """The strategy's transfer mask, [R, K, B]."""
        rows, blocks = active.rows, active.blocks
        full = state.full[rows, blocks] & active.valid
        forced = full & (torch.cumsum(full.long(), dim=1) == 1)  # the lowest fully-activated active block
        width = active.candidates.shape[-1]
        block_scores = BlockScores(
            masked=active.candidates.view(-1, width),
            confidence=grid(scores.confidence.float(), 0.0).view(-1, width),
            entropy=grid(scores.entropy.float(), float("inf")).view(-1, width),
            margin=grid(scores.margin.float(), 0.0).view(-1, width),
            scheduled=state.schedule(rows, blocks, status.remaining[rows, blocks]).view(-1),
            forced=forced.view(-1),
            step=state.forced_steps[rows, blocks].view(-1),
            proposal=grid(scores.proposal, -1).view(-1, width),
        )
        needs = self.strategy.needs
        positions = active.positions.clamp(max=state.width)
        if "previous" in needs:
            block_scores.previous = state.previous[rows[..., None], positions].view(-1, width)
        if "salience" in needs:
            z = logits.float()
            salience = (z.max(-1).values - z.mean(-1)) / z.std(-1).clamp_min(1e-12)
            block_scores.salience = grid(salience, float("-inf")).view(-1, width)
        if "noise" in needs:
            counter = self.counter(state, rows[..., None].expand_as(positions), positions)
            seeds = self.seeds[rows][..., None].expand_as(positions)
            block_scores.noise = uniform_noise(seeds.reshape(-1), counter.reshape(-1), 1).view(-1, width)
        state.forced_steps.index_put_((rows, blocks), forced.long(), accumulate=True)
        transfer = self.strategy.select(block_scores, self.params).view(active.candidates.shape)
        return transfer & active.candidates
