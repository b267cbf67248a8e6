"""Mixture-of-experts layers: transformers' `grouped_mm` experts forward without its sort, gathers and reductions.

`moe_experts(hidden, top_k_index, top_k_weights, gate_up, down, act)` is transformers' `grouped_mm` experts forward
(`integrations/moe.py`: concatenated [gate; up] weights [E, 2I, H], down [E, H, I], no bias, `act(gate) * up`,
weighted and summed over the top-k). At few pairs per expert (`few_pairs`) it runs in four launches. A counting
sort groups the pairs (token, chosen expert) by expert, a program per expert (no `torch.sort`: a radix sort of 2,048
pairs took 29 us on an H200). A program per (expert, column tile) reads its expert's weight tile once for all of
that expert's pairs, gathers their tokens' hidden states itself (no gathered copy), and returns at once for an
expert no pair chose, so a decode step reads only the chosen experts' weights (SDAR-30B-A3B at batch 1: 32 of 128)
and never launches per expert. The down projection writes each pair's row back in the pairs' original order, and a
last launch weighs and sums each token's top-k rows (21 us as inductor's reduction, 4 here). Rounded as transformers
rounds: each projection to the weights' dtype, the activation, the product, each weighted row in the promoted dtype,
the sum in float32.

Beyond `MAX_PAIRS_PER_EXPERT` pairs per expert on average the weight tiles would be re-read per group of rows and
torch's grouped GEMM is the better kernel: the same counting sort, one gather of the hidden rows into expert order,
transformers' two `grouped_mm` calls with the gate in one launch between them, and the weighted sum reading each
pair's row where the sort put it (no scatter back). At DiffusionGemma's batch 16 (32,768 pairs), inductor's gather
and weighted sum of transformers' forward took 408 and 511 us per layer (H200). torch's grouped GEMM reads the group
sizes back to the host except for bfloat16 on compute capability 9.0 and 10.0, so only there may a CUDA graph
capture it (`grouped_mm_captures`). Reference: `moe_experts_reference`.
"""

import functools

import torch
import torch.nn.functional as F

from . import TRITON_AVAILABLE, require_triton
from .compile_ahead import launch
from .device_limits import fitting, shared_memory_limit, shrinking

MAX_PAIRS_PER_EXPERT = 32
# torch >= 2.10 (transformers notes that the private torch._grouped_mm of torch <= 2.8 runs on Hopper only)
GROUPED_MM = getattr(F, "grouped_mm", None)
ACTIVATIONS = ("silu", "gelu_tanh")
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def group_by_expert_reference(expert_of_pair: torch.Tensor, experts: int):
    """(order, offsets, position), int32: the pairs stably sorted by expert, expert e's pairs at order[offsets[e]:
    offsets[e + 1]], and where each pair went (order[position[p]] = p)."""
    expert, order = torch.sort(expert_of_pair, stable=True)
    bounds = torch.arange(experts + 1, device=expert.device, dtype=expert.dtype)
    position = torch.empty_like(order)
    position[order] = torch.arange(order.shape[0], device=order.device)
    return order.int(), torch.searchsorted(expert, bounds).int(), position.int()


def weighted_sum_reference(pair_out: torch.Tensor, top_k_weights: torch.Tensor, position=None) -> torch.Tensor:
    """transformers' last step written out: each pair's row [T·k, H] (row position[p] for pair p when given) times
    its weight [T, k] in the promoted dtype, summed over the top-k in fp32, in order (torch's own sum orders fp32
    terms its way: last-bit differences)."""
    tokens, top_k = top_k_weights.shape
    rows = (pair_out if position is None else pair_out[position.long()]).view(tokens, top_k, -1)
    total = torch.zeros(tokens, rows.shape[2], dtype=torch.float32, device=pair_out.device)
    for j in range(top_k):
        total += (rows[:, j] * top_k_weights[:, j, None]).float()
    return total.to(pair_out.dtype)


def _shared_bytes(config: dict, gated: bool, element_size: int) -> int:
    """The experts kernel's pipelined tiles, num_stages deep: x [BLOCK_M, BLOCK_K] and a weight tile
    [BLOCK_N, BLOCK_K] (gate and up when gated). What Triton 3.9 gives it on sm_90; an upper bound on sm_80."""
    tiles = config["BLOCK_M"] + config["BLOCK_N"] * (2 if gated else 1)
    return config["num_stages"] * tiles * config["BLOCK_K"] * element_size


@functools.lru_cache(maxsize=None)
def _configs(block_m: int, long_rows: bool, gated: bool, element_size: int, limit: int | None) -> tuple:
    """The experts kernel's candidate configurations (`device_limits`): the H200 choice (64 columns, K steps of 128
    for rows of 1,024 and more, else 64; three stages gated, else four), then shorter K steps, fewer stages, columns
    and rows, those that fit `limit`."""
    first = {"BLOCK_M": block_m, "BLOCK_N": 64, "BLOCK_K": 128 if long_rows else 64, "num_stages": 3 if gated else 4}
    candidates = shrinking(first, (("BLOCK_K", 32), ("num_stages", 2), ("BLOCK_N", 16), ("BLOCK_M", 16)))
    return fitting(candidates, lambda config: _shared_bytes(config, gated, element_size), limit)


def few_pairs(tokens: int, top_k: int, experts: int) -> bool:
    return tokens * top_k <= MAX_PAIRS_PER_EXPERT * experts


def computes(tokens: int, top_k: int, experts: int) -> bool:
    """Whether `moe_experts` takes these shapes: few pairs always, many where torch has a grouped GEMM. The count is
    read only without one: traced by torch.compile, it would guard on the token count (a recompile when a call crosses
    the threshold)."""
    return GROUPED_MM is not None or few_pairs(tokens, top_k, experts)


def grouped_mm_captures(weight: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs on weights like `weight` without reading anything back to the host, so that
    a CUDA graph may capture it: bfloat16 on compute capability 9.0 or 10.0 (its CUTLASS kernel; elsewhere it loops
    over the groups with their sizes read on the host). Off CUDA, where nothing is captured, wherever it exists."""
    if GROUPED_MM is None:
        return False
    if weight.device.type != "cuda":
        return True
    return weight.dtype == torch.bfloat16 and torch.cuda.get_device_capability(weight.device) in ((9, 0), (10, 0))


def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: str) -> torch.Tensor:
    """hidden [T, H], top_k_index / top_k_weights [T, k], gate_up [E, 2I, H], down [E, H, I] -> [T, H]."""
    _check(hidden, top_k_index, top_k_weights, gate_up, down, act)
    return torch.ops.hf_blockdiff.moe_experts(hidden, top_k_index.contiguous(), top_k_weights.contiguous(), gate_up,
                                              down, ACTIVATIONS.index(act) + 1)


def _check(hidden, top_k_index, top_k_weights, gate_up, down, act) -> None:
    require_triton("moe_experts")
    experts, double, width = gate_up.shape
    if hidden.dim() != 2 or hidden.shape[1] != width or not hidden.is_contiguous():
        raise ValueError(f"hidden must be contiguous [tokens, {width}], got {list(hidden.shape)}")
    if down.shape != (experts, width, double // 2) or not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError(f"down must be contiguous [{experts}, {width}, {double // 2}] beside gate_up "
                         f"{list(gate_up.shape)}, got {list(down.shape)}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != hidden.shape[0]:
        raise ValueError(f"top_k_index must be [{hidden.shape[0]}, k], got {list(top_k_index.shape)}")
    if top_k_weights.shape != top_k_index.shape or top_k_weights.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"top_k_weights must be {list(top_k_index.shape)} in one of {WEIGHT_DTYPES}, got "
                         f"{list(top_k_weights.shape)} {top_k_weights.dtype}")
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
    if not computes(*top_k_index.shape, experts):
        raise ValueError(f"{top_k_index.numel()} pairs over {experts} experts need torch's grouped GEMM "
                         "(torch.nn.functional.grouped_mm, torch >= 2.10): upgrade torch, or run the experts module's "
                         "own forward (check moe_experts.computes first)")


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
    def _gated(gate, up, dtype: tl.constexpr, ACT: tl.constexpr):
        """act(gate)·up of float32 values already rounded to `dtype`, rounded as transformers' gate rounds: the
        activation, then the product."""
        return round_to(round_to(_activation(gate, ACT), dtype) * up, dtype)

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
                out = _gated(out, round_to(acc_up, dtype), dtype, ACT)
            tl.store(y_ptr + target[:, None].to(tl.int64) * N + cols[None, :], out.to(dtype),
                     mask=live[:, None] & (cols[None, :] < N))

    @triton.jit
    def _gate_kernel(x_ptr, y_ptr, inner, ACT: tl.constexpr, BLOCK: tl.constexpr):
        """y[p] = act(gate)·up of x[p] = [gate; up] (each `inner` wide), as `_gated` rounds."""
        pair = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inner
        gate = tl.load(x_ptr + pair * 2 * inner + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + pair * 2 * inner + inner + cols, mask=ok, other=0.0).to(tl.float32)
        dtype = y_ptr.dtype.element_ty
        tl.store(y_ptr + pair * inner + cols, _gated(gate, up, dtype, ACT).to(dtype), mask=ok)

    @triton.jit
    def _group_kernel(expert_ptr, order_ptr, offsets_ptr, position_ptr, pairs, experts, BLOCK: tl.constexpr):
        """Program e: offsets[e] = pairs of experts before e; order[offsets[e]:] = e's pairs in pair order (a stable
        counting sort, one program per expert), position[p] = where pair p went; offsets[E] = all pairs."""
        e = tl.program_id(0)
        before = tl.zeros([BLOCK], tl.int32)
        for p0 in range(0, pairs, BLOCK):
            p = p0 + tl.arange(0, BLOCK)
            before += (tl.load(expert_ptr + p, mask=p < pairs, other=experts) < e).to(tl.int32)
        start = tl.sum(before, 0)
        tl.store(offsets_ptr + e, start)
        seen = tl.zeros([BLOCK], tl.int32)
        for p0 in range(0, pairs, BLOCK):
            p = p0 + tl.arange(0, BLOCK)
            mine = (tl.load(expert_ptr + p, mask=p < pairs, other=experts) == e).to(tl.int32)
            slot = start + tl.sum(seen, 0) + tl.cumsum(mine, 0) - 1
            tl.store(order_ptr + slot, p, mask=mine > 0)
            tl.store(position_ptr + p, slot, mask=mine > 0)
            seen += mine
        if e == experts - 1:
            tl.store(offsets_ptr + experts, start + tl.sum(seen, 0))

    @triton.jit
    def _combine_kernel(y_ptr, w_ptr, position_ptr, out_ptr, top_k, H, ROUND_PRODUCT: tl.constexpr,
                        GATHER: tl.constexpr, BLOCK_H: tl.constexpr):
        """out[t] = Σ_j y[r] · w[t, j] with r = t·k + j (position[t·k + j] when GATHER), as transformers weighs and
        sums: each product in the promoted dtype (rounded to the pairs' dtype when the weights share it), the sum in
        float32, j in order."""
        token = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = cols < H
        dtype = out_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_H], tl.float32)
        for j in range(top_k):
            pair = token * top_k + j
            source = tl.load(position_ptr + pair) if GATHER else pair
            y = tl.load(y_ptr + source.to(tl.int64) * H + cols, mask=ok, other=0.0).to(tl.float32)
            product = y * tl.load(w_ptr + pair).to(tl.float32)
            acc += round_to(product, dtype) if ROUND_PRODUCT else product
        tl.store(out_ptr + token.to(tl.int64) * H + cols, round_to(acc, dtype).to(dtype), mask=ok)

    def group_by_expert(expert_of_pair: torch.Tensor, experts: int):
        """`group_by_expert_reference` in one launch; expert_of_pair contiguous [P]."""
        pairs = expert_of_pair.shape[0]
        order, position = (expert_of_pair.new_empty(pairs, dtype=torch.int32) for _ in range(2))
        offsets = expert_of_pair.new_empty(experts + 1, dtype=torch.int32)
        # chunks of pairs per step: H200, 2,048 pairs 6.6 -> 4.7 us at 1,024 under eight warps instead of four;
        # 32,768 pairs (DiffusionGemma, batch 16) 45.7 -> 26.0 us at 4,096
        launch(_group_kernel, (experts,), expert_of_pair, order, offsets, position, pairs, experts,
               BLOCK=4096 if pairs > 8192 else 1024, num_warps=8)
        return order, offsets, position

    def weighted_sum(pair_out: torch.Tensor, top_k_weights: torch.Tensor, position=None) -> torch.Tensor:
        """`weighted_sum_reference` in one launch (products not fused into the sum: fp32 rounds as torch's do)."""
        (tokens, top_k), width = top_k_weights.shape, pair_out.shape[1]
        out = pair_out.new_empty(tokens, width)
        launch(_combine_kernel, (tokens, triton.cdiv(width, 512)), pair_out, top_k_weights.contiguous(),
               top_k_weights if position is None else position, out, top_k, width,
               ROUND_PRODUCT=top_k_weights.dtype == pair_out.dtype, GATHER=position is not None, BLOCK_H=512,
               enable_fp_fusion=False)
        return out

    def _grouped(x, order, offsets, weights, out, top_k, act):
        experts, width = weights.shape[0], out.shape[1]
        average = order.shape[0] / experts
        block_m = 16 if average <= 8 else 32 if average <= 24 else 64
        configs = _configs(block_m, x.shape[1] >= 1024, act > 0, x.element_size(), shared_memory_limit(x.device))
        launch(_experts_kernel, lambda config: (experts, triton.cdiv(width, config["BLOCK_N"])),
               x, order, offsets, weights, out, top_k, x.shape[1], width,
               ACT=act, IEEE=ieee_products(x.dtype), num_warps=4, configs=configs)

    @custom_op("hf_blockdiff::moe_experts", mutates_args=())
    def _moe_experts_op(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                        gate_up: torch.Tensor, down: torch.Tensor, act: int) -> torch.Tensor:
        pairs, top_k = top_k_index.numel(), top_k_index.shape[1]
        order, offsets, position = group_by_expert(top_k_index.view(-1), gate_up.shape[0])
        if not few_pairs(*top_k_index.shape, gate_up.shape[0]):
            return _many_pairs(hidden, order, offsets, position, top_k_weights, gate_up, down, act)
        inner = hidden.new_empty(pairs, down.shape[2])
        _grouped(hidden, order, offsets, gate_up, inner, top_k, act)
        pair_out = hidden.new_empty(pairs, hidden.shape[1])
        _grouped(inner, order, offsets, down, pair_out, top_k, 0)
        return weighted_sum(pair_out, top_k_weights)

    def _many_pairs(hidden, order, offsets, position, top_k_weights, gate_up, down, act):
        """transformers' grouped_mm experts forward on the counting sort's grouping."""
        ends = offsets[1:]
        gate_up_out = GROUPED_MM(hidden[order // top_k_weights.shape[1]], gate_up.transpose(1, 2), offs=ends)
        pairs, inner = gate_up_out.shape[0], down.shape[2]
        gated = gate_up_out.new_empty(pairs, inner)
        launch(_gate_kernel, (pairs, triton.cdiv(inner, 1024)), gate_up_out, gated, inner, ACT=act, BLOCK=1024,
               num_warps=4)
        pair_out = GROUPED_MM(gated, down.transpose(1, 2), offs=ends)
        return weighted_sum(pair_out, top_k_weights, position)

    @_moe_experts_op.register_fake
    def _moe_experts_shape(hidden, top_k_index, top_k_weights, gate_up, down, act):
        return torch.empty_like(hidden)
