"""Scores of the positions a step decides: logits → proposal, confidence, entropy, margin, log-prob (docs/architecture.md,
"Scoring and strategies").

Greedy and plain temperature/top-k sampling with the default confidence go through the fused scoring kernel on CUDA
(its torch reference elsewhere: `kernels.scoring`); top-p, per-position temperatures, other confidence sources and float64 scoring take
the general torch path built from the same pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import runs_triton
from ..kernels.canvas_scoring import FUSED_PROBS_DTYPES, canvas_score_reference, canvas_score_triton
from ..kernels.scoring import (combine_shards_reference, combine_shards_triton, distribution_scores, gumbel_argmax,
                              inverse_temperature, score_reference, score_shard_reference, score_shard_triton,
                              score_triton, shard_top_logits, top_k_filter, top_k_rows, top_k_threshold,
                              top_p_filter, top_p_rows)


@dataclass
class Scores:
    proposal: torch.Tensor  # [n] long
    confidence: torch.Tensor  # [n]: probability of the proposal (see SamplingParams.confidence)
    entropy: torch.Tensor  # [n]
    margin: torch.Tensor  # [n]
    logprob: torch.Tensor  # [n]: log-probability of the proposal under the distribution it was drawn from
    salience: torch.Tensor | None = None  # [n]: (max ℓ − mean ℓ) / std ℓ, for the strategies that read it


def logit_salience(logits: torch.Tensor) -> torch.Tensor:
    """How far each row's top logit stands above the rest, in standard deviations."""
    z = logits.float()
    return (z.max(-1).values - z.mean(-1)) / z.std(-1).clamp_min(1e-12)


def penalize_preceding(logits: torch.Tensor, preceding: torch.Tensor, penalty: float) -> torch.Tensor:
    """Diffulex's T2T edit penalty: `penalty` off each row's logit of token `preceding` (-1: none), the token just
    before the position in its block, so a position is less likely to repeat its neighbour (float32 logits)."""
    logits = logits.float()
    amount = torch.where(preceding >= 0, -penalty, 0.0)[:, None]
    return logits.scatter_add(1, preceding.clamp(min=0)[:, None], amount)


@dataclass
class RowSampling:
    """Per scored position, its row's own sampling settings ([n] tensors; docs/architecture.md, "Serving")."""

    inverse_temperature: torch.Tensor  # fl32(1 / T), 1 / T computed in float64 as `inverse_temperature`; 0: greedy
    top_k: torch.Tensor  # ≤ 0: no top-k (greedy rows have none)
    top_p_drop: torch.Tensor  # fl32(1 - top_p), the probability mass top-p drops; 0: no top-p (nor for greedy rows)


@dataclass(frozen=True)
class SamplingParams:
    mask_token_id: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    confidence: str = "filtered"  # "filtered" | "unfiltered" | "raw"
    precision: str = "float32"


def score_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    seed: torch.Tensor,
    counter: torch.Tensor,
    temperature: torch.Tensor | None = None,
    rows: RowSampling | None = None,
) -> Scores:
    """Score [n, V] logits rows. `seed`/`counter` ([n] int64) select each row's sampling noise; `temperature`
    ([n]) overrides the scalar one per row; `rows` replaces the params' temperature, top-k and top-p with each row's
    own (the general path: a row scores the bits the fused path would give it with the same settings)."""
    if rows is not None:
        return _score_rows(logits, params, seed, counter, rows)
    sampling = params.temperature > 0
    if fused_scoring(params, temperature):
        fused = score_triton if runs_triton(logits) else score_reference
        return Scores(*fused(logits, params.mask_token_id, params.temperature, params.top_k, seed, counter))
    dtype = torch.float64 if params.precision == "float64" else torch.float32
    raw = logits.to(dtype).clone()
    raw[:, params.mask_token_id] = float("-inf")
    if not sampling:
        proposal = raw.argmax(dim=-1)
        return Scores(proposal, *distribution_scores(raw, proposal))
    inverse = 1.0 / temperature.float()[:, None] if temperature is not None else inverse_temperature(params.temperature)
    tempered = raw * inverse
    drawn = tempered
    if params.top_k > 0:
        drawn = top_k_filter(drawn, params.top_k)
    if params.top_p < 1.0:
        drawn = top_p_filter(drawn, params.top_p)
    proposal = gumbel_argmax(drawn, seed, counter)
    scores = Scores(proposal, *distribution_scores(drawn, proposal))
    if params.confidence != "filtered":
        reported = tempered if params.confidence == "unfiltered" else raw
        scores.confidence, scores.entropy, scores.margin, _ = distribution_scores(reported, proposal)
    return scores


def fused_scoring(params: SamplingParams, temperature: torch.Tensor | None = None,
                  rows: RowSampling | None = None) -> bool:
    """Whether rows score on the fused path (greedy, or one temperature and top-k, float32, the default confidence)."""
    simple = temperature is None and rows is None and params.top_p >= 1.0 and params.confidence == "filtered"
    return simple and params.precision == "float32"


def score_vocab_shards(logits: torch.Tensor, first: int, params: SamplingParams, seed: torch.Tensor,
                       counter: torch.Tensor, gather) -> Scores:
    """`score_logits` of whole rows on the fused path (`fused_scoring`) from this process's columns of them, logits
    [n, V / P] of token ids first, first + 1, ...: with top-k, `gather` first brings every process's k + 1 largest
    logits a row, whose k-th largest is the whole rows' (`kernels.scoring.top_k_threshold`); each process scores its
    shard (`kernels.scoring.score_shard_reference`), `gather` brings every process's [fields, n] as [P, fields, n] in
    the order of their ids, and their combination gives the scores (docs/architecture.md, "Around the loop": scoring
    on the LM head's vocabulary shards)."""
    fused = runs_triton(logits)
    threshold = None
    if params.temperature > 0 and params.top_k > 0:
        tops = gather(shard_top_logits(logits, first, params.mask_token_id, params.top_k))  # [P, n, k + 1]
        threshold = top_k_threshold(tops.transpose(0, 1).flatten(1), params.top_k,
                                    inverse_temperature(params.temperature))
    shard = (score_shard_triton if fused else score_shard_reference)(
        logits, first, params.mask_token_id, params.temperature, seed, counter, threshold)
    return Scores(*(combine_shards_triton if fused else combine_shards_reference)(gather(shard)))


def _score_rows(logits: torch.Tensor, params: SamplingParams, seed: torch.Tensor, counter: torch.Tensor,
                rows: RowSampling) -> Scores:
    """`score_logits` with each row's own settings: greedy rows take the argmax of the raw logits (times 1), the
    others sample from their tempered, filtered logits, as the scalar path does for each."""
    raw = logits.to(torch.float64 if params.precision == "float64" else torch.float32).clone()
    raw[:, params.mask_token_id] = float("-inf")
    sampled = rows.inverse_temperature > 0
    tempered = raw * torch.where(sampled, rows.inverse_temperature, 1.0)[:, None]
    drawn = top_p_rows(top_k_rows(tempered, rows.top_k), rows.top_p_drop)
    proposal = torch.where(sampled, gumbel_argmax(drawn, seed, counter), drawn.argmax(dim=-1))
    scores = Scores(proposal, *distribution_scores(drawn, proposal))
    if params.confidence != "filtered":
        reported = tempered if params.confidence == "unfiltered" else raw
        scores.confidence, scores.entropy, scores.margin, _ = distribution_scores(reported, proposal)
    return scores


def score_canvas(logits: torch.Tensor, softcap: float | None, temperature: torch.Tensor, seed: torch.Tensor,
                 counter: torch.Tensor, probs_dtype: torch.dtype):
    """A DiffusionGemma step's (sample, argmax, entropy, logprob, probs) from raw LM-head logits [n, V]: the fused
    kernel on CUDA, its torch reference elsewhere (`kernels.canvas_scoring`)."""
    fused = runs_triton(logits) and probs_dtype in FUSED_PROBS_DTYPES
    score = canvas_score_triton if fused else canvas_score_reference
    return score(logits, softcap, temperature, seed, counter, probs_dtype)
