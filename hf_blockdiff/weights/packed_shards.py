"""A tensor-parallel layer's q/k/v shards, and its gate/up shards, back to back in one buffer (docs/architecture.md,
"Around the loop"; docs/benchmarks.md, "Tensor parallel").

A decode step of many tokens (batch 32 of blocks of 4: 128 rows) runs its projections on cuBLAS, q, k and v as three
GEMMs and gate and up as two, and at a shard's widths those are short: on an H200 at SDAR-8B's TP2 widths q/k/v took
26.2 µs as three GEMMs and 11.3 µs as one over the three weights side by side. `pack_shards` (run by `load_sharded` on
the model it loads or builds) moves each layer's local q, k and v shards (and biases), and its gate and up shards, into
one new buffer per group: the parameters stay the same objects with the same values (`torch.utils.swap_tensors`), the
old storage is freed, no memory is added. A one-GPU model is never moved: it is the user's, and its weights as views of
one tensor would stop safetensors' `save_file`.

While decoding (`tensor_parallel.sharded_decoding`), `stacked_projections` finds each attention whose local q, k and v
lie back to back, and each gated MLP whose gate and up do; the call gives the attention their weight (and bias) as one
parameter, `STACKED_QKV` (`STACKED_QKV_BIAS`), and the MLP its gate and up, `STACKED_GATE_UP`: the fused attention
projects through it, and an MLP in forwards of more rows than the skinny kernel takes (`fusion/layers.py`,
`stacked_mlp_forward`); the gated-linear op finds gate and up side by side itself (`kernels.skinny_gemm.stacked`).
"""

from __future__ import annotations

import torch

from ..kernels.skinny_gemm import stacked

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
PACKED = (QKV, GATE_UP)
STACKED_QKV = "blockdiff_stacked_qkv"
STACKED_QKV_BIAS = "blockdiff_stacked_qkv_bias"
STACKED_GATE_UP = "blockdiff_stacked_gate_up"


def _linears(module: torch.nn.Module, names: tuple) -> list | None:
    linears = [getattr(module, name, None) for name in names]
    return linears if all(type(linear) is torch.nn.Linear for linear in linears) else None


def pack_shards(model: torch.nn.Module) -> None:
    """Each module's q/k/v and gate/up shards (weights, and biases) moved into one buffer per group (module doc) where
    all of the group's parameters are DTensors of one dtype and trailing shape (groups already back to back are
    left)."""
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        for names in PACKED:
            for key in ("weight", "bias"):
                params = [linear._parameters.get(key) for linear in _linears(module, names) or ()]
                if params and all(isinstance(p, DTensor) for p in params):
                    _pack(params)


def _pack(params: list) -> None:
    from torch.distributed.tensor import DTensor

    shards = [p.to_local() for p in params]
    first = shards[0]
    if (stacked(shards) is not None
            or any(s.dtype != first.dtype or s.device != first.device or s.shape[1:] != first.shape[1:]
                   for s in shards)):
        return
    buffer = torch.empty(sum(shard.numel() for shard in shards), dtype=first.dtype, device=first.device)
    views, start = [], 0
    with torch.no_grad():
        for shard in shards:
            views.append(buffer[start:start + shard.numel()].view(shard.shape).copy_(shard))
            start += shard.numel()
    for param, view in zip(params, views):
        twin = DTensor.from_local(view, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                  stride=param.stride())
        torch.utils.swap_tensors(param, torch.nn.Parameter(twin, requires_grad=param.requires_grad))


def stacked_projections(model: torch.nn.Module) -> list[tuple[torch.nn.Module, dict[str, torch.Tensor]]]:
    """(module, its stacked projections, views of the weights) for each module whose q, k and v projections
    ({STACKED_QKV: weight[, STACKED_QKV_BIAS: bias]}), or unbiased gate and up projections ({STACKED_GATE_UP:
    weight}), are plain-tensor weights (a sharded model's local shards, inside `sharded_decoding`) lying back to back,
    q/k/v's biases too or absent."""
    found = []
    for module in model.modules():
        for names, weight_name, bias_name in ((QKV, STACKED_QKV, STACKED_QKV_BIAS), (GATE_UP, STACKED_GATE_UP, None)):
            linears = _linears(module, names)
            if linears is None or not all(type(linear.weight.data) is torch.Tensor for linear in linears):
                continue
            weight = stacked([linear.weight for linear in linears])
            biases = [linear.bias for linear in linears]
            bias = None if bias_name is None or any(b is None for b in biases) else stacked(biases)
            if weight is not None and (bias is not None or all(b is None for b in biases)):
                found.append((module, {weight_name: weight} | ({} if bias is None else {bias_name: bias})))
    return found
