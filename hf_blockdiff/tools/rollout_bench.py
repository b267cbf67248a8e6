"""`hf-blockdiff bench --num-return-sequences N [--shared-prefix LEN]`: RL-style rollouts, the samples of each prompt
sharing its K/V pages (and, with a shared prefix, every prompt reading the system prompt from the prefix store)
against the same rows decoded as repeated prompts without sharing; tok/s and the KV pages each run held at most."""

from __future__ import annotations

import math

import torch

from ..config import BlockDiffusionConfig
from ..generation.engine import kv_bytes_per_token


def with_shared_prefix(prompts: torch.Tensor, length: int) -> torch.Tensor:
    """Every prompt starts with the first prompt's first `length` tokens (a system prompt)."""
    prompts = prompts.clone()
    prompts[:, :length] = prompts[0, :length]
    return prompts


def rollout_runs(args, model, cfg: BlockDiffusionConfig, prompts: torch.Tensor) -> list[tuple[str, object]]:
    """(name, run) pairs: the shared rollouts and the repeated-prompt baseline; each run returns its forwards."""
    n = args.num_return_sequences
    shared = cfg
    if args.shared_prefix:
        unit = math.lcm(cfg.runtime.page_size, cfg.block_size)
        shared = cfg.replace(prefix_cache_tokens=-(-args.shared_prefix // unit) * unit)
    repeated = prompts.repeat_interleave(n, 0)

    def sharing():
        return model.generate_multi_block(prompts, shared, num_return_sequences=n, return_dict=True).num_forwards

    def plain():
        return model.generate_multi_block(repeated, cfg, return_dict=True).num_forwards

    return [("shared K/V", sharing), ("repeated prompts", plain)]


def kv_peak(model) -> dict:
    """The KV pages the last call held at most, and their GiB."""
    cache = model._blockdiff_engine.cache
    gib = cache.pages.peak * cache.page_size * kv_bytes_per_token(model) / 2**30
    return {"kv_peak_pages": cache.pages.peak, "kv_peak_gib": round(gib, 3)}
