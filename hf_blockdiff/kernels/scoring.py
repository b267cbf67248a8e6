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
            kth = torch.topk(z, min(top_k, z.shape[-1]), dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, float("-inf"))
    return z


def score_reference(
    logits: torch.Tensor,
    mask_token_id: int,
    temperature: float,
    top_k: int,
    seed: torch.Tensor,
    counter: torch.Tensor,
):
    """Plain-torch scoring of [N, V] logits. The mask token is never proposed. Greedy when temperature == 0,
    else Gumbel-max over softmax(logits / T) restricted to the top-k (k ≤ 0: all)."""
    z = filtered_logits(logits, mask_token_id, temperature, top_k)
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    if temperature > 0:
        proposal = torch.argmax(z + gumbel_noise(seed, counter, z.shape[-1]), dim=-1)
    else:
        proposal = torch.argmax(z, dim=-1)
    logprob = logp.gather(-1, proposal[:, None]).squeeze(-1)
    entropy = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)
    top2 = torch.topk(p, 2, dim=-1).values
    return proposal, logprob.exp(), entropy, top2[:, 0] - top2[:, 1], logprob
