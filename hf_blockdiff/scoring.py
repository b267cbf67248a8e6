"""Scores of the positions a step decides: filtered logits → proposal, confidence, entropy, margin, log-prob."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.scoring import filtered_logits, score_reference


@dataclass
class Scores:
    proposal: torch.Tensor  # [n] long
    confidence: torch.Tensor  # [n] float32: probability of the proposal under the distribution it was drawn from
    entropy: torch.Tensor  # [n] float32
    margin: torch.Tensor  # [n] float32
    logprob: torch.Tensor  # [n] float32


@dataclass(frozen=True)
class SamplingParams:
    mask_token_id: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


def top_p_filter(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper: keep the smallest set of most likely tokens whose probability reaches
    `top_p`, and always the most likely one."""
    sorted_z, order = torch.sort(z, dim=-1, descending=False)
    cumulative = torch.softmax(sorted_z, dim=-1).cumsum(-1)
    drop_sorted = cumulative <= 1 - top_p
    drop_sorted[:, -1] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return z.masked_fill(drop, float("-inf"))


def score_logits(logits: torch.Tensor, params: SamplingParams, seed: torch.Tensor, counter: torch.Tensor) -> Scores:
    """Score [n, V] logits rows; `seed`/`counter` ([n] int64) select each row's sampling noise."""
    temperature, top_k = params.temperature, params.top_k
    if temperature > 0 and params.top_p < 1.0:
        z = filtered_logits(logits, params.mask_token_id, temperature, top_k)
        logits, temperature, top_k = top_p_filter(z, params.top_p), 1.0, 0
    return Scores(*score_reference(logits, params.mask_token_id, temperature, top_k, seed, counter))
