"""Scoring of logits rows: proposal, confidence, entropy, top-1/top-2 margin and log-probability.

The mask token's column is -inf before everything. Greedy (temperature == 0): proposal = argmax logits, ties to
the lowest id; statistics from softmax(logits). Sampling (temperature > 0): z = logits * fl32(1 / temperature),
top_k > 0 keeps z >= the k-th largest z (ties kept, as HF's TopKLogitsWarper), proposal = argmax(z + g) with
Gumbel noise g from rng.uniform_noise(seed, counter); statistics from softmax(z) over the kept tokens.
All statistics in fp32, natural log, 0 * log 0 = 0.
"""

import torch

from . import TRITON_AVAILABLE, require_triton
from .compile_ahead import launch
from .rng import gumbel_noise


def inverse_temperature(temperature):
    """fl32(1 / T): logits are multiplied by it (CUDA turns division by a scalar into this multiply anyway, so
    dividing would not give the same bits on every device)."""
    return float(torch.tensor(1.0 / temperature, dtype=torch.float32))


def top_k_filter(z, top_k):
    """HF TopKLogitsWarper: everything below the k-th largest value goes to -inf (ties at the boundary kept)."""
    kth = z.topk(min(top_k, z.shape[1]), dim=1).values[:, -1:]
    return z.masked_fill(z < kth, float("-inf"))


def top_p_filter(z: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper: keep the smallest set of most likely tokens whose probability reaches
    `top_p`, and always the most likely one."""
    return top_p_rows(z, torch.full(z.shape[:1], 1 - top_p, dtype=z.dtype, device=z.device))


def top_k_rows(z, top_k):
    """`top_k_filter` with each row's own k ([N]; ≤ 0 keeps the row whole): the k-th largest value of a row is
    the one `topk` gives, so a row filters as `top_k_filter` would filter it alone."""
    ordered = z.sort(dim=1, descending=True).values
    kth = ordered.gather(1, (top_k.clamp(1, z.shape[1]) - 1)[:, None])
    return z.masked_fill((z < kth) & (top_k > 0)[:, None], float("-inf"))


def top_p_rows(z, top_p_drop):
    """`top_p_filter` with each row's own 1 - top_p ([N], the mass it drops; 0 keeps the row whole)."""
    sorted_z, order = torch.sort(z, dim=-1, descending=False)
    cumulative = torch.softmax(sorted_z, dim=-1).cumsum(-1)
    drop_sorted = (cumulative <= top_p_drop[:, None].to(cumulative.dtype)) & (top_p_drop > 0)[:, None]
    drop_sorted[:, -1] = False
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return z.masked_fill(drop, float("-inf"))


def distribution_scores(z, proposal):
    """Confidence, entropy, margin and log-prob of `proposal` under softmax(z), in z's dtype."""
    logp = torch.log_softmax(z, dim=1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(dim=1)
    top2 = p.topk(2, dim=1).values
    logprob = logp.gather(1, proposal[:, None])[:, 0]
    return logprob.exp(), entropy, top2[:, 0] - top2[:, 1], logprob


def gumbel_argmax(z, seed, counter):
    """argmax(z + g) with the rows' counter-based Gumbel noise (finite, so -inf entries never win)."""
    return (z + gumbel_noise(seed, counter, z.shape[1]).to(z.dtype)).argmax(dim=1)


def score_reference(logits, mask_token_id, temperature, top_k, seed, counter):
    """Plain torch scoring of logits [N, V] (fp64 logits are scored in fp64); seed, counter int64 [N]
    (unused, may be None, when temperature == 0).

    Returns (proposal int64, confidence, entropy, margin, logprob), each [N]."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)).clone()
    z[:, mask_token_id] = float("-inf")
    if temperature > 0:
        z = z * inverse_temperature(temperature)
        if top_k > 0:
            z = top_k_filter(z, top_k)
        proposal = gumbel_argmax(z, seed, counter)
    else:
        proposal = z.argmax(dim=1)
    return proposal, *distribution_scores(z, proposal)


def _top_k_threshold(logits, mask_token_id, inv_temperature, top_k):
    """The k-th largest kept z per row, from torch.topk on the raw logits (z is monotone in the logits)."""
    vals, idx = logits.topk(min(top_k + 1, logits.shape[1]), dim=1)
    vals = vals.float().masked_fill(idx == mask_token_id, float("-inf"))
    kth = vals.sort(dim=1, descending=True).values[:, min(top_k, vals.shape[1]) - 1]
    return kth * inv_temperature


def score_triton(logits, mask_token_id, temperature, top_k, seed, counter, block_v=None):
    """Fused scoring with the semantics of score_reference: one program per row reads the row once
    (online softmax with running max, sum and sum of p * log p terms, top-2 and Gumbel-max argmax tracking),
    never building an fp32 [N, V] tensor. With top_k > 0 the k-th largest z per row comes first from
    torch.topk on the raw logits ([N, k + 1] values, no fp32 copy of the logits), then the same fused pass.
    block_v (vocabulary chunk per step, 8 per thread) defaults to the fastest on an H100: sampling carries
    three more per-lane vectors, so it takes half the chunk of greedy to stay clear of register spills."""
    require_triton("score_triton")
    N, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    sample = temperature > 0
    block_v = block_v or (4096 if sample else 8192)
    inv_temperature = inverse_temperature(temperature) if sample else 1.0
    filtered = sample and top_k > 0
    dev = logits.device
    proposal = torch.empty(N, device=dev, dtype=torch.int64)
    stats = torch.empty(4, N, device=dev, dtype=torch.float32)
    if N == 0:
        return proposal, *stats
    threshold = _top_k_threshold(logits, mask_token_id, inv_temperature, top_k) if filtered else stats[0]
    launch(_score_kernel, (N,),
        logits, logits.stride(0), seed, counter, threshold, proposal, stats, N, V, mask_token_id, inv_temperature,
        SAMPLE=sample, FILTER=filtered, BLOCK_V=block_v, num_warps=max(1, min(32, block_v // 256)),
    )
    return proposal, *stats


if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .rng import row_key_tl, uniform_noise_tl

    @triton.jit
    def _online_softmax_update(z, m, s_vec, w_vec):
        """One chunk of the running max m, Σ e^(z - m) and Σ e^(z - m)·(z - m) (for the entropy)."""
        m_new = tl.maximum(m, tl.max(z, 0))
        alpha = tl.exp(m - m_new)
        d = z - m_new
        e = tl.exp(d)
        w_vec = alpha * (w_vec + (m - m_new) * s_vec) + e * tl.where(e > 0, d, 0.0)
        return m_new, alpha * s_vec + e, w_vec

    @triton.jit
    def _top2_update(z, cols, t1, t2, i1):
        """Per lane: the largest value (and its column) and the second largest seen so far."""
        t2 = tl.where(z > t1, t1, tl.maximum(t2, z))
        i1 = tl.where(z > t1, cols, i1)
        return tl.maximum(t1, z), t2, i1

    @triton.jit
    def _store_stats(stats_ptr, row, N, confidence, entropy, margin, logprob):
        tl.store(stats_ptr + row, confidence)
        tl.store(stats_ptr + N + row, entropy)
        tl.store(stats_ptr + 2 * N + row, margin)
        tl.store(stats_ptr + 3 * N + row, logprob)

    @triton.jit
    def _score_kernel(
        x_ptr, s_x, seed_ptr, counter_ptr, thr_ptr, prop_ptr, stats_ptr, N, V, mask_id, inv_temperature,
        SAMPLE: tl.constexpr, FILTER: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        # Per-lane running state; one cross-lane reduction (the chunk max) per chunk, the rest at the end.
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * s_x
        lanes = tl.arange(0, BLOCK_V)
        neg_inf = float("-inf")
        if SAMPLE:
            key = row_key_tl(tl.load(seed_ptr + row), tl.load(counter_ptr + row))
        if FILTER:
            thr = tl.load(thr_ptr + row)

        m = tl.full([], -1.0e30, tl.float32)
        s_vec = tl.zeros([BLOCK_V], tl.float32)  # sum of e^(z - m)
        w_vec = tl.zeros([BLOCK_V], tl.float32)  # sum of e^(z - m) * (z - m)
        t1 = tl.full([BLOCK_V], neg_inf, tl.float32)
        t2 = tl.full([BLOCK_V], neg_inf, tl.float32)
        i1 = tl.zeros([BLOCK_V], tl.int32)  # a row of nan or -inf only gives token 0, never an id past V
        if SAMPLE:
            best = tl.full([BLOCK_V], neg_inf, tl.float32)
            best_i = tl.zeros([BLOCK_V], tl.int32)
            best_z = tl.full([BLOCK_V], neg_inf, tl.float32)
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            z = tl.load(x_row + cols, mask=cols < V, other=neg_inf).to(tl.float32)
            z = tl.where(cols == mask_id, neg_inf, z)
            if SAMPLE:
                z = z * inv_temperature
            if FILTER:
                z = tl.where(z >= thr, z, neg_inf)

            m, s_vec, w_vec = _online_softmax_update(z, m, s_vec, w_vec)
            t1, t2, i1 = _top2_update(z, cols, t1, t2, i1)
            if SAMPLE:
                perturbed = z - tl.log(-tl.log(uniform_noise_tl(key, cols)))
                better = perturbed > best  # nan (excluded token with infinite noise) never wins
                best = tl.where(better, perturbed, best)
                best_i = tl.where(better, cols, best_i)
                best_z = tl.where(better, z, best_z)

        s = tl.sum(s_vec, 0)
        log_s = tl.log(s)
        top1 = tl.max(t1, 0)
        top1_i = tl.min(tl.where(t1 == top1, i1, V), 0)
        top2 = tl.maximum(tl.max(t2, 0), tl.max(tl.where(i1 == top1_i, neg_inf, t1), 0))
        if SAMPLE:
            prop = tl.min(tl.where(best == tl.max(best, 0), best_i, V), 0)
            z_prop = tl.max(tl.where(best_i == prop, best_z, neg_inf), 0)
        else:
            prop = top1_i
            z_prop = top1
        logprob = z_prop - m - log_s
        tl.store(prop_ptr + row, prop.to(tl.int64))
        _store_stats(stats_ptr, row, N, tl.exp(logprob), log_s - tl.sum(w_vec, 0) / s,
                     (tl.exp(top1 - m) - tl.exp(top2 - m)) / s, logprob)
