"""Stock transformers modules with their projections as skinny-GEMM ops (`kernels/skinny_gemm.py`: a Triton kernel
for forwards of few tokens, where a decode step's time is reading the weights; cuBLAS for more), while decoding
(docs/design.md, "Kernels and backends").

- Gated MLPs (`LlamaMLP`, `Qwen2MLP`, `Qwen3MLP`, `Qwen3MoeMLP`: down(silu(gate(x)) · up(x))): gate, up and the
  activation in one `gated_linear`, the down projection in a one-weight `grouped_linear`.
- Qwen-style attention (`Qwen2Attention`, `Qwen3Attention`, `Qwen3MoeAttention`): q, k and v in one `grouped_linear`,
  then the stock steps as transformers writes them (the q/k RMSNorms where the class has them, rotary embedding, the
  configured attention function, the output projection as the down projection).

`fused_forwards(model)` picks modules of exactly these classes, with no hook of their own, whose projections are
plain `nn.Linear` layers with contiguous plain weights in the model's dtype (no LoRA wrapper, no quantized,
offloaded or tensor-parallel weight, no hook), MLPs with SiLU and unbiased gate/up; the others, and a forward given
a transformers cache, run the stock forward.
"""

from __future__ import annotations

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaMLP, eager_attention_forward
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention, Qwen3MLP, apply_rotary_pos_emb
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeAttention, Qwen3MoeMLP

from ..kernels import TRITON_AVAILABLE
from ..kernels.skinny_gemm import gated_linear, grouped_linear

GATED_MLPS = (LlamaMLP, Qwen2MLP, Qwen3MLP, Qwen3MoeMLP)
QWEN_ATTENTIONS = (Qwen2Attention, Qwen3Attention, Qwen3MoeAttention)  # one forward (q/k norms optional)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _unhooked(module: torch.nn.Module) -> bool:
    """No forward hooks, no forward set on the instance (accelerate's offload and dispatch hooks set one)."""
    return (not module._forward_hooks and not module._forward_pre_hooks and "forward" not in vars(module)
            and not hasattr(module, "_hf_hook"))


def _plain(linear: torch.nn.Module, dtype: torch.dtype) -> bool:
    weight = linear.weight
    return (type(linear) is torch.nn.Linear and _unhooked(linear) and type(weight.data) is torch.Tensor
            and weight.dtype == dtype and weight.is_contiguous() and weight.device.type != "meta")


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _project(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    (out,) = grouped_linear(_flat(x), [linear.weight], [linear.bias])
    return out.view(*x.shape[:-1], linear.out_features)


def fused_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    hidden = gated_linear(_flat(x), self.gate_proj.weight, self.up_proj.weight)
    return _project(self.down_proj, hidden.view(*x.shape[:-1], self.gate_proj.out_features))


def fused_attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                            **kwargs):
    if past_key_values is not None or kwargs.get("cache") is not None:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                                  **kwargs)
    input_shape = hidden_states.shape[:-1]
    projections = (self.q_proj, self.k_proj, self.v_proj)
    query, key, value = (
        out.view(*input_shape, out.shape[-1] // self.head_dim, self.head_dim) for out in grouped_linear(
            _flat(hidden_states), [p.weight for p in projections],
            [p.bias for p in projections]))
    if hasattr(self, "q_norm"):
        query, key = self.q_norm(query), self.k_norm(key)
    cos, sin = position_embeddings
    query, key = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    attended, weights = attention(
        self, query, key, value.transpose(1, 2), attention_mask,
        dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
        sliding_window=self.sliding_window, **kwargs)
    return _project(self.o_proj, attended.reshape(*input_shape, -1).contiguous()), weights


def _fusable(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Exactly a listed transformers class (not a subclass or a look-alike of the same name), unhooked, with plain
    projections; MLPs with SiLU and unbiased gate/up (`gated_linear` takes no bias), attentions with q, k and v all
    biased or all not."""
    if type(module) in GATED_MLPS:
        linears = (module.gate_proj, module.up_proj, module.down_proj)
        if (type(module.act_fn).__name__ not in ("SiLU", "SiLUActivation") or module.gate_proj.bias is not None
                or module.up_proj.bias is not None):
            return False
    elif type(module) in QWEN_ATTENTIONS:
        linears = (module.q_proj, module.k_proj, module.v_proj, module.o_proj)
        if len({p.bias is None for p in linears[:3]}) != 1:
            return False
    else:
        return False
    return _unhooked(module) and all(_plain(p, dtype) for p in linears)


def fused_forwards(model: torch.nn.Module) -> list[tuple[torch.nn.Module, object]]:
    """(module, forward) for every module to run fused while decoding (none without Triton)."""
    dtype = model.dtype
    if not TRITON_AVAILABLE or dtype not in _DTYPES:
        return []
    forwards = []
    for module in model.modules():
        if _fusable(module, dtype):
            fused = fused_mlp_forward if type(module) in GATED_MLPS else fused_attention_forward
            forwards.append((module, fused.__get__(module)))
    return forwards
