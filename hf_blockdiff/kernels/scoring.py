"""Scoring of logits rows: proposal, confidence, entropy, top-1/top-2 margin and log-probability.

The mask token's column is -inf before everything. Greedy (temperature == 0): proposal = argmax logits, ties to
the lowest id; statistics from softmax(logits). Sampling (temperature > 0): z = logits * fl32(1 / temperature),
top_k > 0 keeps z >= the k-th largest z (ties kept, as HF's TopKLogitsWarper), proposal = argmax(z + g) with
Gumbel noise g from rng.uniform_noise(seed, counter); statistics from softmax(z) over the kept tokens.
All statistics in fp32, natural log, 0 * log 0 = 0.

A row split by vocabulary over processes (tensor parallel) scores shard by shard: each shard's state
(`score_shard_reference`, the kernel's pass with PARTIAL), then their combination (`combine_shards_reference`) gives
the whole row's scores (docs/architecture.md, "Around the loop": scoring on the LM head's vocabulary shards).
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


# a vocabulary shard's state per row (`score_shard_reference`): what `combine_shards_reference` needs of its columns
PARTIAL_FIELDS = 8  # running max m, Σ e^(z - m), Σ e^(z - m)·(z - m), top-1, top-2, the pick's z, key and id
_NEG_INF = float("-inf")


def score_shard_reference(logits, first, mask_token_id, temperature, seed, counter, threshold=None):
    """Plain torch scoring of one vocabulary shard: logits [N, V] of token ids first, first + 1, ...; `threshold`
    ([N] or None): the whole rows' k-th largest kept z when sampling with top-k (`top_k_threshold`), below which z is
    -inf. Returns [PARTIAL_FIELDS, N] float32: m = max z (at least -1e30), Σ e^(z - m), Σ e^(z - m)·(z - m), the two
    largest z, the pick's z, the pick's key (its z + Gumbel noise when sampling, else z) and the pick's id (a float,
    exact below 2^24); ties to the lowest id."""
    z = logits.float().clone()
    ids = first + torch.arange(z.shape[1], device=z.device)
    z[:, ids == mask_token_id] = _NEG_INF
    if temperature > 0:
        z = z * inverse_temperature(temperature)
    if threshold is not None:
        z = z.where(z >= threshold[:, None], _NEG_INF)
    m = z.amax(1).clamp_min(-1.0e30)
    d = z - m[:, None]
    e = d.exp()
    top = torch.cat([z, z.new_full((len(z), 1), _NEG_INF)], 1).topk(2, dim=1).values
    key = z + gumbel_noise(seed, counter, z.shape[1], first) if temperature > 0 else z
    pick = key.argmax(1)
    fields = (m, e.sum(1), (e * torch.where(e > 0, d, 0.0)).sum(1), top[:, 0], top[:, 1],
              z.gather(1, pick[:, None])[:, 0], key.amax(1), ids[pick].float())
    return torch.stack(fields)


def combine_shards_reference(partials):
    """The scores of whole rows from every shard's `score_shard_reference` [shards, PARTIAL_FIELDS, N] (shards in
    the order of their ids): (proposal, confidence, entropy, margin, logprob) as `score_reference` gives them."""
    m_r, s_r, w_r, top1_r, top2_r, z_r, key_r, pick_r = partials.unbind(1)
    m = m_r.amax(0)
    scale = (m_r - m).exp()
    s, w = (scale * s_r).sum(0), (scale * (w_r + (m_r - m) * s_r)).sum(0)
    top1 = top1_r.amax(0)
    first_top = (top1_r == top1).int().argmax(0)[None]  # one shard holding it; the others' top-1s may be the top-2
    top2 = torch.maximum(top2_r.amax(0), top1_r.scatter(0, first_top, _NEG_INF).amax(0))
    chosen = (key_r == key_r.amax(0)).int().argmax(0)[None]
    return _scores(pick_r.gather(0, chosen)[0].long(), m, s, w, top1, top2, z_r.gather(0, chosen)[0])


def _scores(proposal, m, s, w, top1, top2, z_pick):
    log_s = s.log()
    logprob = z_pick - m - log_s
    return proposal, logprob.exp(), log_s - w / s, ((top1 - m).exp() - (top2 - m).exp()) / s, logprob


def shard_top_logits(logits, first, mask_token_id, top_k):
    """A vocabulary shard's k + 1 largest logits per row as float32 [N, min(k + 1, V)] (logits [N, V] of token ids
    first..), the mask token's -inf: its candidates for `top_k_threshold` (the rows' k largest kept logits lie among
    the shards' k + 1 largest, of which at most one is the mask token's)."""
    values, columns = logits.topk(min(top_k + 1, logits.shape[1]), dim=1)
    return values.float().masked_fill(columns + first == mask_token_id, _NEG_INF)


def top_k_threshold(candidates, top_k, inv_temperature):
    """The k-th largest kept z per row from every shard's `shard_top_logits` side by side [N, M] (z is monotone in
    the logits); -inf where the rows hold fewer than k tokens (then every token is kept)."""
    if candidates.shape[1] < top_k:
        return candidates.new_full(candidates.shape[:1], _NEG_INF)
    return candidates.topk(top_k, dim=1).values[:, -1] * inv_temperature


def score_triton(logits, mask_token_id, temperature, top_k, seed, counter, block_v=None):
    """Fused scoring with the semantics of score_reference: one program per row reads the row once
    (online softmax with running max, sum and sum of p * log p terms, top-2 and Gumbel-max argmax tracking),
    never building an fp32 [N, V] tensor. With top_k > 0 the k-th largest z per row comes first from
    torch.topk on the raw logits ([N, k + 1] values, no fp32 copy of the logits), then the same fused pass.
    block_v (vocabulary chunk per step, 8 per thread) defaults to the fastest on an H100: sampling carries
    three more per-lane vectors, so it takes half the chunk of greedy to stay clear of register spills."""
    N = logits.shape[0]
    proposal = torch.empty(N, device=logits.device, dtype=torch.int64)
    stats = torch.empty(4, N, device=logits.device, dtype=torch.float32)
    threshold = None
    if temperature > 0 and top_k > 0:
        threshold = top_k_threshold(shard_top_logits(logits, 0, mask_token_id, top_k), top_k,
                                    inverse_temperature(temperature))
    _launch_score(logits, mask_token_id, temperature, threshold, seed, counter, block_v, 0, (proposal, stats))
    return proposal, *stats


def score_shard_triton(logits, first, mask_token_id, temperature, seed, counter, threshold=None, block_v=None):
    """`score_shard_reference` by the fused kernel (`score_triton`'s pass over the shard's columns)."""
    partial = torch.empty(PARTIAL_FIELDS, logits.shape[0], device=logits.device, dtype=torch.float32)
    _launch_score(logits, mask_token_id, temperature, threshold, seed, counter, block_v, first, partial)
    return partial


def _launch_score(logits, mask_token_id, temperature, threshold, seed, counter, block_v, first, out):
    """The scoring kernel over logits [N, V], token ids first.. (a vocabulary shard), into `out`: (proposal, stats)
    or, for a shard, the partial state [PARTIAL_FIELDS, N]; `threshold`: [N] float32, z below it filtered out (top-k),
    or None."""
    require_triton("score_triton")
    N, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    sample = temperature > 0
    block_v = block_v or (4096 if sample else 8192)
    inv_temperature = inverse_temperature(temperature) if sample else 1.0
    partial = isinstance(out, torch.Tensor)
    proposal, stats = (out, out) if partial else out
    if N == 0:
        return
    launch(_score_kernel, (N,),
        logits, logits.stride(0), seed, counter, stats if threshold is None else threshold, proposal, stats, N, V,
        first, mask_token_id, inv_temperature, SAMPLE=sample, FILTER=threshold is not None, PARTIAL=partial,
        BLOCK_V=block_v,
        num_warps=max(1, min(32, block_v // 256)),
    )


def combine_shards_triton(partials):
    """`combine_shards_reference` in one launch (a program per 128 rows)."""
    require_triton("combine_shards_triton")
    shards, _, N = partials.shape
    proposal = torch.empty(N, device=partials.device, dtype=torch.int64)
    stats = torch.empty(4, N, device=partials.device, dtype=torch.float32)
    if N:
        launch(_combine_kernel, (triton.cdiv(N, 128),), partials.contiguous(), proposal, stats, N, SHARDS=shards,
               BLOCK_N=128, num_warps=4)
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
    def _store_scores(prop_ptr, stats_ptr, rows, N, ok, proposal, m, s, w, top1, top2, z_pick):
        """`_scores` of rows (scalar or vector) into proposal [N] and stats [4, N]."""
        log_s = tl.log(s)
        logprob = z_pick - m - log_s
        tl.store(prop_ptr + rows, proposal.to(tl.int64), mask=ok)
        tl.store(stats_ptr + rows, tl.exp(logprob), mask=ok)
        tl.store(stats_ptr + N + rows, log_s - w / s, mask=ok)
        tl.store(stats_ptr + 2 * N + rows, (tl.exp(top1 - m) - tl.exp(top2 - m)) / s, mask=ok)
        tl.store(stats_ptr + 3 * N + rows, logprob, mask=ok)

    @triton.jit
    def _top2_of_lanes(t1, t2, i1, end):
        """The row's top-1 (the lowest id among equals; `end`: past every id), its id and its top-2."""
        top1 = tl.max(t1, 0)
        top1_i = tl.min(tl.where(t1 == top1, i1, end), 0)
        return top1, top1_i, tl.maximum(tl.max(t2, 0), tl.max(tl.where(i1 == top1_i, float("-inf"), t1), 0))

    @triton.jit
    def _pick_of_lanes(best, best_i, best_z, end):
        """The row's largest perturbed z, its id (the lowest among equals) and its z."""
        pick_key = tl.max(best, 0)
        pick = tl.min(tl.where(best == pick_key, best_i, end), 0)
        return pick_key, pick, tl.max(tl.where(best_i == pick, best_z, float("-inf")), 0)

    @triton.jit
    def _store_shard(field, N, m, s, w, top1, top2, z_pick, pick_key, pick):
        """A row's fields of score_shard_reference, N apart from `field` on."""
        tl.store(field, m)
        tl.store(field + N, s)
        tl.store(field + 2 * N, w)
        tl.store(field + 3 * N, top1)
        tl.store(field + 4 * N, top2)
        tl.store(field + 5 * N, z_pick)
        tl.store(field + 6 * N, pick_key)
        tl.store(field + 7 * N, pick.to(tl.float32))

    @triton.jit
    def _score_kernel(
        x_ptr, s_x, seed_ptr, counter_ptr, thr_ptr, prop_ptr, stats_ptr, N, V, first, mask_id, inv_temperature,
        SAMPLE: tl.constexpr, FILTER: tl.constexpr, PARTIAL: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        # Per-lane running state; one cross-lane reduction (the chunk max) per chunk, the rest at the end. Token ids
        # are first + the column (a vocabulary shard's); PARTIAL stores the shard's state (score_shard_reference).
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
            ids = first + cols
            z = tl.load(x_row + cols, mask=cols < V, other=neg_inf).to(tl.float32)
            z = tl.where(ids == mask_id, neg_inf, z)
            if SAMPLE:
                z = z * inv_temperature
            if FILTER:
                z = tl.where(z >= thr, z, neg_inf)

            m, s_vec, w_vec = _online_softmax_update(z, m, s_vec, w_vec)
            t1, t2, i1 = _top2_update(z, ids, t1, t2, i1)
            if SAMPLE:
                perturbed = z - tl.log(-tl.log(uniform_noise_tl(key, ids)))
                better = perturbed > best  # nan (excluded token with infinite noise) never wins
                best = tl.where(better, perturbed, best)
                best_i = tl.where(better, ids, best_i)
                best_z = tl.where(better, z, best_z)

        s = tl.sum(s_vec, 0)
        w = tl.sum(w_vec, 0)
        top1, top1_i, top2 = _top2_of_lanes(t1, t2, i1, first + V)
        if SAMPLE:
            pick_key, prop, z_prop = _pick_of_lanes(best, best_i, best_z, first + V)
        else:
            pick_key = top1
            prop = top1_i
            z_prop = top1
        if PARTIAL:
            _store_shard(stats_ptr + row, N, m, s, w, top1, top2, z_prop, pick_key, prop)
        else:
            _store_scores(prop_ptr, stats_ptr, row, N, row < N, prop, m, s, w, top1, top2, z_prop)

    @triton.jit
    def _combine_kernel(part_ptr, prop_ptr, stats_ptr, N, SHARDS: tl.constexpr, BLOCK_N: tl.constexpr):
        """combine_shards_reference for BLOCK_N rows: shards in id order, so a strict `>` keeps the lowest id."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = rows < N
        m = tl.full([BLOCK_N], -1.0e30, tl.float32)
        for r in tl.static_range(SHARDS):
            m = tl.maximum(m, tl.load(part_ptr + r * 8 * N + rows, mask=ok, other=-1.0e30))
        s = tl.zeros([BLOCK_N], tl.float32)
        w = tl.zeros([BLOCK_N], tl.float32)
        top1 = tl.full([BLOCK_N], float("-inf"), tl.float32)
        top2 = tl.full([BLOCK_N], float("-inf"), tl.float32)
        pick_key = tl.full([BLOCK_N], float("-inf"), tl.float32)
        z_pick = tl.full([BLOCK_N], float("-inf"), tl.float32)
        pick = tl.zeros([BLOCK_N], tl.float32)
        for r in tl.static_range(SHARDS):
            field = part_ptr + r * 8 * N + rows
            m_r, s_r, w_r = tl.load(field, mask=ok), tl.load(field + N, mask=ok), tl.load(field + 2 * N, mask=ok)
            scale = tl.exp(m_r - m)
            s += scale * s_r
            w += scale * (w_r + (m_r - m) * s_r)
            top1_r, top2_r = tl.load(field + 3 * N, mask=ok), tl.load(field + 4 * N, mask=ok)
            top2 = tl.maximum(tl.maximum(top2, top2_r), tl.minimum(top1, top1_r))
            top1 = tl.maximum(top1, top1_r)
            key_r = tl.load(field + 6 * N, mask=ok)
            better = key_r > pick_key
            pick_key = tl.where(better, key_r, pick_key)
            z_pick = tl.where(better, tl.load(field + 5 * N, mask=ok), z_pick)
            pick = tl.where(better, tl.load(field + 7 * N, mask=ok), pick)
        _store_scores(prop_ptr, stats_ptr, rows, N, ok, pick, m, s, w, top1, top2, z_pick)
