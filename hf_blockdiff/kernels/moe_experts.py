"""Mixture-of-experts layers at few tokens: the experts' two GEMMs where reading the expert weights is the work.

`moe_experts(hidden, top_k_index, top_k_weights, gate_up, down, act)` is transformers' `grouped_mm` experts forward
(`integrations/moe.py`: concatenated [gate; up] weights [E, 2I, H], down [E, H, I], no bias, `act(gate) * up`)
in two launches. Pairs (token, chosen expert) are sorted by expert; a program per (expert, column tile) reads its
expert's weight tile once for all of that expert's pairs, gathers their tokens' hidden states itself (no gathered
copy), and returns at once for an expert no pair chose, so a decode step reads only the chosen experts' weights
(SDAR-30B-A3B at batch 1: 32 of 128) and never launches per expert. The down projection writes each pair's row back
in the pairs' original order, so the weighting and the sum over the top-k run as transformers runs them, in torch.
Rounded as transformers rounds: each projection to the weights' dtype, the activation, the product.

Beyond `MAX_PAIRS_PER_EXPERT` pairs per expert on average the weight tiles would be re-read per group of rows and
cuBLAS's grouped GEMM is the better kernel; callers check `few_pairs`. Reference: `moe_experts_reference`.
"""

import torch
import torch.nn.functional as F

from . import TRITON_AVAILABLE, require_triton
from .compile_ahead import launch

MAX_PAIRS_PER_EXPERT = 32
ACTIVATIONS = ("silu", "gelu_tanh")


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    return F.silu(x) if act == "silu" else F.gelu(x, approximate="tanh")


def moe_experts_reference(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """Each pair through its expert in plain torch, weighted, summed over the top-k in fp32."""
    tokens, top_k = top_k_index.shape
    out = torch.zeros(tokens, top_k, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for expert in top_k_index.unique().tolist():
        token, slot = (top_k_index == expert).nonzero(as_tuple=True)
        gate, up = F.linear(hidden[token], gate_up[expert]).chunk(2, dim=-1)
        pair_out = F.linear(activation(gate, act) * up, down[expert])
        out[token, slot] = (pair_out * top_k_weights[token, slot, None]).float()
    return out.sum(1).to(hidden.dtype)


def few_pairs(tokens: int, top_k: int, experts: int) -> bool:
    return tokens * top_k <= MAX_PAIRS_PER_EXPERT * experts


def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """hidden [T, H], top_k_index / top_k_weights [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H]."""
    _check(hidden, top_k_index, gate_up, down, act)
    tokens, top_k = top_k_index.shape
    expert_of_pair, order = torch.sort(top_k_index.reshape(-1))
    boundaries = torch.arange(gate_up.shape[0] + 1, device=hidden.device, dtype=expert_of_pair.dtype)
    offsets = torch.searchsorted(expert_of_pair, boundaries).to(torch.int32)  # expert e: pairs [off[e], off[e+1])
    pair_out = torch.ops.hf_blockdiff.moe_experts(hidden, order, offsets, gate_up, down, ACTIVATIONS.index(act) + 1)
    weighted = pair_out * top_k_weights.reshape(-1, 1)  # as transformers weights and sums: same dtypes, same order
    return weighted.view(tokens, top_k, -1).sum(dim=1).to(hidden.dtype)


def _check(hidden, top_k_index, gate_up, down, act) -> None:
    require_triton("moe_experts")
    experts, double, width = gate_up.shape
    if hidden.dim() != 2 or hidden.shape[1] != width or not hidden.is_contiguous():
        raise ValueError(f"hidden must be contiguous [tokens, {width}], got {list(hidden.shape)}")
    if down.shape != (experts, width, double // 2) or not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError(f"down must be contiguous [{experts}, {width}, {double // 2}] beside gate_up "
                         f"{list(gate_up.shape)}, got {list(down.shape)}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden.shape[0]:
        raise ValueError(f"top_k_index must be [{hidden.shape[0]}, k], got {list(top_k_index.shape)}")
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")


if TRITON_AVAILABLE:
    import triton
    import triton.language as tl
    from torch.library import custom_op

    from .rounding import dot_t, ieee_products, round_to

    @triton.jit
    def _activation(x, ACT: tl.constexpr):
        if ACT == 1:  # SiLU
            return x / (1.0 + tl.exp(-x))
        inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # GELU, tanh approximation
        return 0.5 * x * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * inner)))

    @triton.jit
    def _experts_kernel(x_ptr, order_ptr, offsets_ptr, w_ptr, y_ptr, top_k, K, N,
                        ACT: tl.constexpr, IEEE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """ACT > 0: y[pair] = act(x[token]·Wgᵀ)·(x[token]·Wuᵀ), pairs in expert order (W = w[e]: [2N, K]);
        ACT = 0: y[order[pair]] = x[pair]·w[e]ᵀ (w[e]: [N, K]), back in the pairs' original order."""
        expert = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        start = tl.load(offsets_ptr + expert)
        end = tl.load(offsets_ptr + expert + 1)
        rk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + expert.to(tl.int64) * (2 * N if ACT > 0 else N) * K + cols[:, None].to(tl.int64) * K
        dtype = y_ptr.dtype.element_ty
        for m0 in range(start, end, BLOCK_M):
            rm = m0 + tl.arange(0, BLOCK_M)
            live = rm < end
            order = tl.load(order_ptr + rm, mask=live, other=0)
            source = order // top_k if ACT > 0 else rm
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            acc_up = acc
            for k0 in range(0, K, BLOCK_K):
                ks = k0 + rk
                x = tl.load(x_ptr + source[:, None].to(tl.int64) * K + ks[None, :],
                            mask=live[:, None] & (ks[None, :] < K), other=0.0)
                w_mask = (cols[:, None] < N) & (ks[None, :] < K)
                acc = dot_t(x, tl.load(w_rows + ks[None, :], mask=w_mask, other=0.0), acc, IEEE)
                if ACT > 0:
                    up = tl.load(w_rows + N * K + ks[None, :], mask=w_mask, other=0.0)
                    acc_up = dot_t(x, up, acc_up, IEEE)
            out = round_to(acc, dtype)
            target = order if ACT == 0 else rm
            if ACT > 0:
                out = round_to(round_to(_activation(out, ACT), dtype) * round_to(acc_up, dtype), dtype)
            tl.store(y_ptr + target[:, None].to(tl.int64) * N + cols[None, :], out.to(dtype),
                     mask=live[:, None] & (cols[None, :] < N))

    def _grouped(x, order, offsets, weights, out, top_k, act):
        experts, width = weights.shape[0], out.shape[1]
        average = order.shape[0] / experts
        block_m = 16 if average <= 8 else 32 if average <= 24 else 64
        launch(_experts_kernel, (experts, triton.cdiv(width, 64)),
               x, order, offsets, weights, out, top_k, x.shape[1], width,
               ACT=act, IEEE=ieee_products(x.dtype),
               BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128 if x.shape[1] >= 1024 else 64, num_warps=4, num_stages=3)

    @custom_op("hf_blockdiff::moe_experts", mutates_args=())
    def _moe_experts_op(hidden: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, act: int) -> torch.Tensor:
        pairs, top_k = order.shape[0], order.shape[0] // hidden.shape[0]
        inner = hidden.new_empty(pairs, down.shape[2])
        _grouped(hidden, order, offsets, gate_up, inner, top_k, act)
        out = hidden.new_empty(pairs, hidden.shape[1])
        _grouped(inner, order, offsets, down, out, top_k, 0)
        return out

    @_moe_experts_op.register_fake
    def _moe_experts_shape(hidden, order, offsets, gate_up, down, act):
        return hidden.new_empty(order.shape[0], hidden.shape[1])
