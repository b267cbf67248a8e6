"""transformers' MoE experts on `kernels/moe_experts.py` while decoding (docs/kernels.md, "Kernels and backends").

transformers' experts classes (`@use_experts_implementation`: Qwen3-MoE's, so SDAR-MoE's, DiffusionGemma's, ...)
run their experts as `config._experts_implementation` says, `grouped_mm` by default on GPUs: a sort, a gather, two
cuBLAS grouped GEMMs, an activation, a weighted sum. `fused_experts(model)` gives the experts modules of the stock
layout (concatenated gate/up, not transposed, no bias, no expert norm, the default gate with SiLU or tanh-GELU,
plain contiguous weights, no hooks, not expert parallel) a forward that runs `moe_experts`: its own GEMMs when the
pairs are few per expert, torch's grouped GEMM between its own grouping and weighted sum when they are many (decided
by shapes: graph- and compile-safe), and the class's own forward for many pairs where torch's grouped GEMM would
read back to the host (`grouped_mm_captures`, decided when the forward is installed).
`fusion.decoding_mode` installs it for a block and removes it after.

Sharded experts (tensor or expert parallel: DTensor weights, a forward transformers set on the instance, or its
`_is_expert_parallel` mark) are skipped, not run on their local experts: their own forward runs, which maps the global
expert ids to the local ones, masks the routes to other processes' experts and sums the processes' outputs
(weights/sharding.py). Correctness first: the op would need that mapping and the sum of its own.
"""

from __future__ import annotations

import functools

import torch

from ..kernels import TRITON_AVAILABLE
from ..kernels.moe_experts import few_pairs, grouped_mm_captures, moe_experts
from .layers import unhooked

try:
    from transformers.activations import GELUTanh, SiLUActivation
    from transformers.integrations.moe import _default_apply_gate
except ImportError:  # a transformers without the experts interface: experts run as they are
    _default_apply_gate = None


def _activation(act_fn) -> str | None:
    if type(act_fn) is SiLUActivation:
        return "silu"
    if type(act_fn) is GELUTanh and isinstance(act_fn.act, functools.partial):  # not its pure-Python variant
        return "gelu_tanh"
    return None


def _stock(module: torch.nn.Module) -> bool:
    """A transformers experts module of the layout the kernel computes, unhooked, with plain weights."""
    if not hasattr(module, "has_gate") or _default_apply_gate is None or _activation(module.act_fn) is None:
        return False
    weights = (module.gate_up_proj, module.down_proj)
    return (module.has_gate and getattr(module, "is_concatenated", True) and not module.has_bias
            and not module.is_transposed and not getattr(module, "has_post_expert_norm", False)  # (transformers 5.23)
            and not getattr(module, "_is_expert_parallel", False)
            and type(module)._apply_gate is _default_apply_gate and unhooked(module)
            and all(type(w.data) is torch.Tensor and w.is_contiguous() and w.device.type != "meta" for w in weights)
            and weights[0].dtype == weights[1].dtype)


def fused_experts(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """(module, forward) for every stock experts module of the model (none without Triton): a method bound from a
    module-level function, the same at every install (docs/kernels.md, "Kernels and backends", MoE experts)."""
    if not TRITON_AVAILABLE:
        return []
    return [(m, (_any_pairs_forward if grouped_mm_captures(m.gate_up_proj) else _few_pairs_forward).__get__(m))
            for m in model.modules() if _stock(m)]


def _any_pairs_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """Every shape on the op: many pairs per expert too, on torch's grouped GEMM (`grouped_mm_captures`)."""
    return _forward(self, True, hidden_states, top_k_index, top_k_weights)


def _few_pairs_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                       top_k_weights: torch.Tensor) -> torch.Tensor:
    """The op for few pairs per expert; many go to the class's own forward (torch's grouped GEMM would read back)."""
    return _forward(self, False, hidden_states, top_k_index, top_k_weights)


def _forward(self, many_pairs: bool, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    taken = many_pairs or few_pairs(*top_k_index.shape, self.num_experts)
    if hidden_states.dtype != self.gate_up_proj.dtype or not taken:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    return moe_experts(hidden_states.contiguous(), top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                       _activation(self.act_fn))
