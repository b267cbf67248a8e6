"""Scoring of a DiffusionGemma denoising step: raw LM-head logits [N, V] → the sample, the argmax, the entropy and the
argmax's log-probability of every row, and the softmax that self-conditions the next step.

processed = softcap(logits) / T with softcap(x) = tanh(x / c) · c in float32 (none when c is None) and T a 0-dim
float32 tensor (the step's temperature, read on the device so a captured step follows the schedule). Of
softmax(processed): sample = argmax(processed + g) with the rows' counter-based Gumbel noise g (`rng`), argmax (ties
to the lowest id), entropy, log-probability of the argmax; probs = softmax(processed cast to the model dtype, in
float32), cast to the model dtype — the input of the self-conditioning GEMM, as transformers' DiffusionGemma
computes it.

`canvas_score_triton` reads the logits twice (statistics, then the probabilities) and builds no [N, V] tensor but
its output probabilities. Each lane keeps its own running max and sums, combined once per row after the first pass:
a reduction across the program's lanes per chunk cost 15 % of the kernel at batch 16 (H200).
`canvas_score_reference` is the plain torch version it is tested against (ulp differences apart: the kernel's tanh,
exp and log are not torch's).
"""

import torch

from . import TRITON_AVAILABLE, require_triton
from .compile_ahead import launch
from .scoring import gumbel_argmax

NOISE_ELEMENTS = 1 << 24  # Gumbel noise values hashed at once by the torch reference
FUSED_PROBS_DTYPES = (torch.float32, torch.bfloat16)  # the probabilities canvas_score_triton writes


def processed_logits(logits: torch.Tensor, softcap: float | None, temperature: torch.Tensor) -> torch.Tensor:
    """softcap(logits) / T in float32 (float64 logits stay float64: the tests' exact reference)."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is not None:
        x = torch.tanh(x / softcap) * softcap
    return x / temperature


def categorical_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per row, computed as `torch.distributions.Categorical(logits=...).entropy()` does
    (normalized logits clamped at the dtype's minimum, times the probabilities)."""
    normalized = logits - logits.logsumexp(-1, keepdim=True)
    probs = torch.softmax(normalized, -1)
    return -(normalized.clamp(min=torch.finfo(logits.dtype).min) * probs).sum(-1)


def gumbel_rows_argmax(z: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """`scoring.gumbel_argmax` in row chunks of at most NOISE_ELEMENTS noise values (the int64 hash of a whole
    [N, 262144] step would not fit in memory)."""
    rows = max(1, NOISE_ELEMENTS // z.shape[1])
    return torch.cat([gumbel_argmax(z[i : i + rows], seed[i : i + rows], counter[i : i + rows])
                      for i in range(0, z.shape[0], rows)])


def canvas_statistics(processed: torch.Tensor, probs_dtype: torch.dtype):
    """(argmax, entropy, log-probability of the argmax, probs) of processed logits [N, V] (float32)."""
    logprob = processed.max(-1).values - processed.logsumexp(-1)
    probs = processed.to(probs_dtype).softmax(-1, dtype=torch.float32).to(probs_dtype)
    return processed.argmax(-1), categorical_entropy(processed), logprob, probs


def canvas_score_reference(logits, softcap, temperature, seed, counter, probs_dtype):
    """Plain torch: (sample, argmax, entropy, logprob, probs); seed and counter int64 [N]."""
    processed = processed_logits(logits, softcap, temperature)
    return gumbel_rows_argmax(processed, seed, counter), *canvas_statistics(processed, probs_dtype)


def canvas_score_triton(logits, softcap, temperature, seed, counter, probs_dtype, block_v=None):
    """Fused canvas_score_reference: one program per row (float32 or bfloat16 probabilities). block_v (vocabulary
    chunk per step) defaults to the fastest measured on an H200: 4,096 for a batch-1 canvas, 1,024 from 1,024 rows
    on (batch 4 and more), where the rows alone fill the GPU."""
    require_triton("canvas_score_triton")
    if probs_dtype not in FUSED_PROBS_DTYPES:
        raise ValueError(f"canvas_score_triton: probs_dtype={probs_dtype} is not float32 or bfloat16; use "
                         "canvas_score_reference.")
    N, V = logits.shape
    block_v = block_v or (1024 if N >= 1024 else 4096)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    dev = logits.device
    sample = torch.empty(N, device=dev, dtype=torch.int64)
    argmax = torch.empty(N, device=dev, dtype=torch.int64)
    stats = torch.empty(2, N, device=dev, dtype=torch.float32)
    probs = torch.empty(N, V, device=dev, dtype=probs_dtype)
    if N:
        cap = 1.0 if softcap is None else float(softcap)
        inverse_cap = float(torch.tensor(1.0 / cap, dtype=torch.float32))
        launch(_canvas_score_kernel, (N,),
            logits, logits.stride(0), temperature.float().reshape(1), seed, counter, sample, argmax, stats, probs, N,
            V, cap, inverse_cap, SOFTCAP=softcap is not None, ROUND_BF16=probs_dtype == torch.bfloat16,
            BLOCK_V=block_v, num_warps=max(1, min(16, block_v // 128)),
        )
    return sample, argmax, stats[0], stats[1], probs


if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .rng import row_key_tl, uniform_noise_tl
    from .rounding import round_bf16

    @triton.jit
    def _processed(x_row, cols, V, temperature, cap, inverse_cap, SOFTCAP: tl.constexpr):
        """softcap(logits) / T at `cols` (-inf past the vocabulary); tanh(y) = 1 − 2 / (e^(2y) + 1)."""
        x = tl.load(x_row + cols, mask=cols < V, other=0.0).to(tl.float32)
        if SOFTCAP:
            x = (1.0 - 2.0 / (tl.exp(2.0 * (x * inverse_cap)) + 1.0)) * cap
        return tl.where(cols < V, tl.math.div_rn(x, temperature), float("-inf"))

    @triton.jit
    def _lane_update(z, m, s):
        """Per lane (no reduction across lanes): the new running max and Σ e^(z − max), one exponential per value
        (e^(m − z) rescales the sum when z is the new max, else e^(z − m) is the new term); also z − m, that
        exponential and whether z is the new max. m starts finite (-1e30), so past the vocabulary (z = -inf) e is 0;
        a nan value makes the lane's sum nan, so the row's entropy shows it (canvas.schedule stops the call)."""
        d = z - m
        e = tl.exp(-tl.abs(d))
        up = z > m
        return tl.maximum(m, z), tl.where(up, s * e + 1.0, s + e), d, e, up

    @triton.jit
    def _lane_sum(m, s):
        """(max, Σ e^(z − max)) of a row from its lanes' running max and sum."""
        top = tl.max(m, 0)
        return top, tl.sum(s * tl.exp(m - top), 0)

    @triton.jit
    def _canvas_score_kernel(
        x_ptr, s_x, t_ptr, seed_ptr, counter_ptr, sample_ptr, argmax_ptr, stats_ptr, probs_ptr, N, V, cap,
        inverse_cap, SOFTCAP: tl.constexpr, ROUND_BF16: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        # Every running statistic is per lane; lanes meet once, after the first pass.
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * s_x
        lanes = tl.arange(0, BLOCK_V)
        temperature = tl.load(t_ptr)
        key = row_key_tl(tl.load(seed_ptr + row), tl.load(counter_ptr + row))
        m = tl.full([BLOCK_V], -1.0e30, tl.float32)
        s = tl.zeros([BLOCK_V], tl.float32)  # Σ e^(z − m)
        w = tl.zeros([BLOCK_V], tl.float32)  # Σ e^(z − m)·(z − m), for the entropy
        m_rounded = tl.full([BLOCK_V], -1.0e30, tl.float32)
        s_rounded = tl.zeros([BLOCK_V], tl.float32)  # Σ e^(round(z) − max round(z)), for the bfloat16 softmax
        top_i = tl.zeros([BLOCK_V], tl.int32)  # a row of nan or -inf only gives token 0, never an id past V
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK_V], tl.int32)
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            z = _processed(x_row, cols, V, temperature, cap, inverse_cap, SOFTCAP)
            top_i = tl.where(z > m, cols, top_i)
            m, s_new, d, e, up = _lane_update(z, m, s)
            w = tl.where(up, (w - d * s) * e, w + e * tl.where(e > 0, d, 0.0))  # rescaled to the new max
            s = s_new
            if ROUND_BF16:
                m_rounded, s_rounded, _, _, _ = _lane_update(round_bf16(z), m_rounded, s_rounded)
            perturbed = z - tl.log(-tl.log(uniform_noise_tl(key, cols)))
            best_i = tl.where(perturbed > best, cols, best_i)
            best = tl.maximum(best, perturbed)
        top_value, total = _lane_sum(m, s)
        scale = tl.exp(m - top_value)
        entropy_sum = tl.sum(scale * (w + (m - top_value) * s), 0)  # Σ e^(z − max)·(z − max)
        tl.store(argmax_ptr + row, tl.min(tl.where(m == top_value, top_i, V), 0).to(tl.int64))
        tl.store(sample_ptr + row, tl.min(tl.where(best == tl.max(best, 0), best_i, V), 0).to(tl.int64))
        tl.store(stats_ptr + row, tl.log(total) - entropy_sum / total)
        tl.store(stats_ptr + N + row, -tl.log(total))
        if ROUND_BF16:
            top_value, total = _lane_sum(m_rounded, s_rounded)
        p_row = probs_ptr + row.to(tl.int64) * V
        for start in range(0, V, BLOCK_V):
            cols = start + lanes
            z = _processed(x_row, cols, V, temperature, cap, inverse_cap, SOFTCAP)
            if ROUND_BF16:
                p = round_bf16(tl.exp(round_bf16(z) - top_value) / total)
            else:
                p = tl.exp(z - top_value) / total
            tl.store(p_row + cols, p.to(probs_ptr.dtype.element_ty), mask=cols < V)
