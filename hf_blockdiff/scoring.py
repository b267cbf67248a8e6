"""Scores of the positions a step decides: logits → proposal, confidence, entropy, margin, log-prob (DESIGN §5).

Greedy and plain temperature/top-k sampling with the default confidence go through the fused scoring kernel's
semantics (`kernels.scoring`); top-p, per-position temperatures, other confidence sources and float64 scoring take
the general torch path built from the same pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.rng import gumbel_noise
from .kernels.scoring import distribution_scores, score_reference, top_k_filter


@dataclass
class Scores:
    proposal: torch.Tensor  # [n] long
    confidence: torch.Tensor  # [n]: probability of the proposal (see SamplingParams.confidence)
    entropy: torch.Tensor  # [n]
    margin: torch.Tensor  # [n]
    logprob: torch.Tensor  # [n]: log-probability of the proposal under the distribution it was drawn from


@dataclass(frozen=True)
class SamplingParams:
    mask_token_id: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    confidence: str = "filtered"  # "filtered" | "unfiltered" | "raw"
    precision: str = "float32"


def top_p_filter(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper: keep the smallest set of most likely tokens whose probability reaches
    `top_p`, and always the most likely one."""
    sorted_z, order = torch.sort(z, dim=-1, descending=False)
    cumulative = torch.softmax(sorted_z, dim=-1).cumsum(-1)
    drop_sorted = cumulative <= 1 - top_p
    drop_sorted[:, -1] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return z.masked_fill(drop, float("-inf"))


def score_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    seed: torch.Tensor,
    counter: torch.Tensor,
    temperature: torch.Tensor | None = None,
) -> Scores:
    """Score [n, V] logits rows. `seed`/`counter` ([n] int64) select each row's sampling noise; `temperature`
    ([n]) overrides the scalar one per row."""
    sampling = params.temperature > 0
    simple = temperature is None and params.top_p >= 1.0 and params.confidence == "filtered"
    if simple and params.precision == "float32":
        return Scores(*score_reference(logits, params.mask_token_id, params.temperature, params.top_k, seed, counter))
    dtype = torch.float64 if params.precision == "float64" else torch.float32
    raw = logits.to(dtype).clone()
    raw[:, params.mask_token_id] = float("-inf")
    tempered = raw / (temperature[:, None] if temperature is not None else params.temperature) if sampling else raw
    drawn = tempered
    if sampling and params.top_k > 0:
        drawn = top_k_filter(drawn, params.top_k)
    if sampling and params.top_p < 1.0:
        drawn = top_p_filter(drawn, params.top_p)
    if sampling:
        proposal = torch.argmax(drawn + gumbel_noise(seed, counter, drawn.shape[-1]).to(dtype), dim=-1)
    else:
        proposal = torch.argmax(drawn, dim=-1)
    confidence, _, _, logprob = distribution_scores(drawn, proposal)
    reported = {"filtered": drawn, "unfiltered": tempered, "raw": raw}[params.confidence]
    confidence, entropy, margin, _ = distribution_scores(reported, proposal)
    return Scores(proposal, confidence, entropy, margin, logprob)
