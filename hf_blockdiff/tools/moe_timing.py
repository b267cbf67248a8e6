"""How close an MoE layer runs to dense GEMMs of its own shapes (reported by `hf-blockdiff bench` on MoE models).

For `tokens` hidden states, one MoE layer (router, grouped experts, shared experts; the model's own module) is timed
against the dense-equivalent work: every routed expert as one batched GEMM over `tokens · k / E` rows (perfectly
balanced routing, no sort, gather or scatter), followed by the shared experts as plain GEMMs — the same FLOPs and
the same weight bytes as the layer. Both replay in a CUDA graph (median of `triton.testing.do_bench_cudagraph`), so
launch overhead is left out of both (`microbench.time_ms`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .microbench import time_ms


def moe_layer(model):
    """The first layer's MLP that has routed experts (None: the model has none)."""
    return next((module for module in model.modules() if hasattr(module, "experts") and hasattr(module, "gate")),
                None)


@torch.no_grad()
def moe_against_dense(model, tokens: int) -> dict:
    """Microseconds of the model's MoE layer on `tokens` random hidden states, of its dense-equivalent GEMMs, and their
    ratio (CUDA only)."""
    config = model.config.get_text_config()
    mlp, device, dtype = moe_layer(model), model.device, model.dtype
    hidden = torch.randn(tokens, config.hidden_size, device=device, dtype=dtype)
    experts, k = mlp.experts, config.num_experts_per_tok
    rows = -(-tokens * k // experts.num_experts)
    routed = torch.randn(experts.num_experts, rows, config.hidden_size, device=device, dtype=dtype)
    shared = getattr(mlp, "shared_experts", None)

    def dense():
        gate, up = torch.bmm(routed, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
        torch.bmm(F.silu(gate) * up, experts.down_proj.transpose(1, 2))
        if shared is not None:
            shared(hidden)

    moe_us = 1e3 * time_ms(lambda: mlp(hidden[None]), "cuda", graph=True)
    dense_us = 1e3 * time_ms(dense, "cuda", graph=True)
    return {"tokens": tokens, "moe_layer_us": round(moe_us, 1), "dense_equivalent_us": round(dense_us, 1),
            "ratio": round(moe_us / dense_us, 2), "experts_implementation": config._experts_implementation}
