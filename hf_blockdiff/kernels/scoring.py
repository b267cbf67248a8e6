"""Scoring of logits rows: proposal, confidence, entropy, top-1/top-2 margin, log-prob (DESIGN §5)."""

from __future__ import annotations

import torch

from .rng import gumbel_noise


def filtered_logits(logits: torch.Tensor, mask_token_id: int, temperature: float, top_k: int) -> torch.Tensor:
    """fp32 logits with the mask token at -inf, divided by the temperature and cut to the top-k when sampling."""
    z = logits.float().clone()
    z[:, mask_token_id] = float("-inf")
    if temperature > 0:
        z = z / temperature
        if top_k > 0:
            z = top_k_filter(z, top_k)
    return z


def top_k_filter(z: torch.Tensor, top_k: int) -> torch.Tensor:
    """transformers' TopKLogitsWarper: everything below the k-th largest value goes to -inf (ties kept)."""
    kth = torch.topk(z, min(top_k, z.shape[-1]), dim=-1).values[:, -1:]
    return z.masked_fill(z < kth, float("-inf"))


def distribution_scores(z: torch.Tensor, proposal: torch.Tensor):
    """Confidence, entropy, margin and log-prob of `proposal` under softmax(z) (z's dtype)."""
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    logprob = logp.gather(-1, proposal[:, None]).squeeze(-1)
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    top2 = torch.topk(p, 2, dim=-1).values
    return logprob.exp(), entropy, top2[:, 0] - top2[:, 1], logprob


def score_reference(
    logits: torch.Tensor,
    mask_token_id: int,
    temperature: float,
    top_k: int,
    seed: torch.Tensor,
    counter: torch.Tensor,
):
    """Plain-torch scoring of [N, V] logits. The mask token is never proposed. Greedy when temperature == 0,
    else Gumbel-max over softmax(logits / T) restricted to the top-k (k ≤ 0: all).
    Returns proposal, confidence, entropy, margin, log-prob ([N] each; float32)."""
    z = filtered_logits(logits, mask_token_id, temperature, top_k)
    if temperature > 0:
        proposal = torch.argmax(z + gumbel_noise(seed, counter, z.shape[-1]), dim=-1)
    else:
        proposal = torch.argmax(z, dim=-1)
    return (proposal, *distribution_scores(z, proposal))
