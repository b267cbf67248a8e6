"""Stock transformers modules with their projections as skinny-GEMM ops (`kernels/skinny_gemm.py`: a Triton kernel
for forwards of few tokens, where a decode step's time is reading the weights; cuBLAS for more), while decoding
(docs/kernels.md, "Kernels and backends").

- Gated MLPs (`LlamaMLP`, `Qwen2MLP`, `Qwen3MLP`, `Qwen3MoeMLP`: down(silu(gate(x)) · up(x))): gate, up and the
  activation in one `gated_linear`, the down projection in a one-weight `grouped_linear`; in forwards of more rows,
  given gate and up stacked by a tensor-parallel call (`weights/packed_shards.py`), gate and up as one GEMM.
- Qwen-style attention (`Qwen2Attention`, `Qwen3Attention`, `Qwen3MoeAttention`): q, k and v in one `grouped_linear`
  (over their stacked weight where a tensor-parallel call gives one, `weights/packed_shards.py`), then the stock steps
  as transformers writes them (the q/k RMSNorms where the class has them, rotary embedding, the configured attention
  function, the output projection as the down projection). Under hf_blockdiff's attention, with stock q/k norms (or
  none), q and k go to the attention function as projected (`blockdiff_rotary`): the cache's write kernel applies the
  norms and the rotary embedding (`kernels/rotary_write.py`).
- Decoder layers (`Qwen2DecoderLayer`, `Qwen3DecoderLayer`, `Qwen3MoeDecoderLayer`) whose attention and gated MLP are
  fused and whose norms are stock, when the layers are not compiled: the residual add after the attention in the
  post-attention RMSNorm's launch (`add_rms_norm`), the one after the MLP in the down projection's
  (`linear_residual`).

`fused_forwards(model)` picks modules of exactly these classes, with no hook of their own, whose projections are
plain `nn.Linear` layers with contiguous plain weights in the model's dtype (no LoRA wrapper, no quantized,
offloaded or DTensor weight, no hook: a tensor-parallel model's layers qualify on their local shards, inside
`weights.tensor_parallel.sharded_decoding`), MLPs with SiLU and unbiased gate/up; the others, and a forward given
a transformers cache, run the stock forward.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaMLP, eager_attention_forward
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2DecoderLayer, Qwen2MLP, Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention, Qwen3DecoderLayer, Qwen3MLP, Qwen3RMSNorm, apply_rotary_pos_emb,
)
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeAttention, Qwen3MoeDecoderLayer, Qwen3MoeMLP, Qwen3MoeRMSNorm,
)

from ..attention import blockdiff_attention_forward
from ..cache.keyword import kv_cache_argument
from ..kernels import TRITON_AVAILABLE
from ..kernels.rmsnorm import add_rms_norm
from ..kernels.skinny_gemm import MAX_ROWS, gated_linear, grouped_linear, linear_residual
from ..weights.packed_shards import STACKED_GATE_UP, STACKED_QKV, STACKED_QKV_BIAS
from ..weights.tensor_parallel import row_parallel, row_parallel_norm, row_parallel_product

GATED_MLPS = (LlamaMLP, Qwen2MLP, Qwen3MLP, Qwen3MoeMLP)
QWEN_ATTENTIONS = (Qwen2Attention, Qwen3Attention, Qwen3MoeAttention)  # one forward (q/k norms optional)
QK_NORMS = (Qwen3RMSNorm, Qwen3MoeRMSNorm)
RMS_NORMS = (Qwen2RMSNorm, *QK_NORMS)  # forward: kernels.rmsnorm.rms_norm_reference
# one forward; layers whose attention is one of QWEN_ATTENTIONS (Llama's is not fused, so neither are its layers)
DECODER_LAYERS = (Qwen2DecoderLayer, Qwen3DecoderLayer, Qwen3MoeDecoderLayer)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def unhooked(module: torch.nn.Module) -> bool:
    """No forward hooks, no forward set on the instance (accelerate's offload and dispatch hooks set one) but the
    row-parallel one of a sharded layer while decoding (`weights.tensor_parallel.sharded_decoding`)."""
    return (not module._forward_hooks and not module._forward_pre_hooks and not hasattr(module, "_hf_hook")
            and ("forward" not in vars(module) or row_parallel(module)))


def plain_linear(linear: torch.nn.Module, dtype: torch.dtype) -> bool:
    weight = linear.weight
    return (type(linear) is torch.nn.Linear and unhooked(linear) and type(weight.data) is torch.Tensor
            and weight.dtype == dtype and weight.is_contiguous() and weight.device.type != "meta")


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _project(linear: torch.nn.Linear, x: torch.Tensor, invariant: bool,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """`linear(x)`, plus `residual` in the product's launch where given; a row-parallel layer's partial product summed
    over the ranks (the residual added with the sum)."""
    if row_parallel(linear):
        return row_parallel_product(linear, x, True, invariant, residual)
    if residual is None:
        (out,) = grouped_linear(_flat(x), [linear.weight], [linear.bias], invariant)
    else:
        out = linear_residual(_flat(x), linear.weight, linear.bias, _flat(residual), invariant)
    return out.view(*x.shape[:-1], out.shape[-1])


def fused_mlp_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                      invariant: bool = False) -> torch.Tensor:
    """The gated MLP; `residual`: added in the down projection's launch (`fused_layer_forward`, `mlp_residual`);
    `invariant`: the skinny GEMMs' batch-invariant launches (every forward below takes it)."""
    hidden = gated_linear(_flat(x), self.gate_proj.weight, self.up_proj.weight, invariant)
    return _project(self.down_proj, hidden.view(*x.shape[:-1], hidden.shape[-1]), invariant, residual)


def stacked_mlp_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The gated MLP in forwards of more rows than the skinny kernel takes, given its gate and up stacked (a sharded
    model's call, `weights/packed_shards.py`): one GEMM for both, then the stock steps (compiled, inductor fuses the
    activation and the product as in the stock MLP); `residual`: added with the row-parallel down projection's sum
    (`mlp_residual`)."""
    gate, up = F.linear(x, getattr(self, STACKED_GATE_UP)).split(self.gate_proj.weight.shape[0], dim=-1)
    hidden = self.act_fn(gate) * up
    if residual is None:
        return self.down_proj(hidden)
    return row_parallel_product(self.down_proj, hidden, False, residual=residual)


RESIDUAL_MLPS = (fused_mlp_forward, stacked_mlp_forward)  # the MLP forwards that take the residual stream


def mlp_residual(mlp: torch.nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + mlp(x): added with the down projection's sum where it is row-parallel and the MLP runs one of
    `RESIDUAL_MLPS` (a sharded model's decoding: no launch of its own), else after."""
    if row_parallel(getattr(mlp, "down_proj", None)) and getattr(mlp.forward, "__func__", None) in RESIDUAL_MLPS:
        return mlp(x, residual=residual)
    return residual + mlp(x)


def attention_residual_norm(attention: torch.nn.Module, attended: torch.Tensor, residual: torch.Tensor,
                            norm: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """residual + the attention's output projection of `attended`, and `norm` of it (a decoder layer's post-attention
    RMSNorm); for a row-parallel projection without bias and a stock norm, both in the sum's op, which reads the sum
    out of the symmetric buffer adding the residual and normalizing (`weights/all_reduce.py`)."""
    o_proj = attention.o_proj
    if row_parallel(o_proj) and o_proj.bias is None and type(norm) in RMS_NORMS and unhooked(norm):
        return row_parallel_norm(o_proj, attended.reshape(*attended.shape[:2], -1).contiguous(), residual, norm)
    hidden_states = residual + output_projection(attention, attended)
    return hidden_states, norm(hidden_states)


def stock_with_cache(self, hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                     position_embeddings, kwargs):
    """The stock decoder layer's output where the forward was given a transformers cache, else None (the caller's
    fused path runs)."""
    cache = kv_cache_argument(past_key_values, kwargs)
    if cache is None:
        return None
    # the cache's parameter is the fourth on every version, whatever its name
    return type(self).forward(self, hidden_states, attention_mask, position_ids, cache, use_cache, position_embeddings,
                              **kwargs)


def fused_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                        use_cache=False, position_embeddings=None, invariant=False, **kwargs):
    """transformers' decoder layer with its residual adds in other launches: after the attention in the
    post-attention RMSNorm's (`add_rms_norm`), after the MLP in the down projection's (`linear_residual`)."""
    stock = stock_with_cache(self, hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                             position_embeddings, kwargs)
    if stock is not None:
        return stock
    attended, _ = self.self_attn(
        hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask, position_ids=position_ids,
        use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    norm = self.post_attention_layernorm
    residual, normed = add_rms_norm(hidden_states, attended, norm.weight, norm.variance_epsilon)
    return fused_mlp_forward(self.mlp, normed, residual, invariant)


def _rotates_in_cache(attention: torch.nn.Module) -> bool:
    """Whether the attention's q/k steps are exactly what `kernels.rotary_write` applies: no q/k norms, or stock
    RMSNorms over head_dim with one eps, no hooks."""
    if not hasattr(attention, "q_norm"):
        return True
    norms = (attention.q_norm, attention.k_norm)
    return (all(type(n) in QK_NORMS and unhooked(n) and n.weight.shape == (attention.head_dim,) for n in norms)
            and norms[0].variance_epsilon == norms[1].variance_epsilon)


def _qkv_projections(self, x: torch.Tensor, invariant: bool) -> list[torch.Tensor]:
    """x's q, k and v projections [rows, Nᵢ] in one launch: through the stacked weight where the call gave one
    (`weights.packed_shards`; then views of one output), else over the three weights."""
    projections = (self.q_proj, self.k_proj, self.v_proj)
    weight = getattr(self, STACKED_QKV, None)
    if weight is None:
        return grouped_linear(x, [p.weight for p in projections], [p.bias for p in projections], invariant)
    (out,) = grouped_linear(x, [weight], [getattr(self, STACKED_QKV_BIAS, None)], invariant, max_rows=MAX_ROWS)
    return out.split([p.weight.shape[0] for p in projections], dim=-1)


def query_key_value(self, hidden_states, position_embeddings, rotary_in_cache: bool, invariant: bool = False):
    """The attention's q, k and v as [R, heads, W, D] (one `grouped_linear`), and the rotary steps left to the cache's
    write kernel (`blockdiff_rotary`: cos, sin, the q/k norms' weights or None, eps), or None where they were applied
    here as transformers writes them."""
    input_shape = hidden_states.shape[:-1]
    query, key, value = (out.view(*input_shape, out.shape[-1] // self.head_dim, self.head_dim).transpose(1, 2)
                         for out in _qkv_projections(self, _flat(hidden_states), invariant))
    cos, sin = position_embeddings
    if rotary_in_cache:
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.variance_epsilon) if hasattr(self, "q_norm") \
            else (None, None, 0.0)
        return query, key, value, (cos, sin, *norms)
    if hasattr(self, "q_norm"):
        query, key = self.q_norm(query), self.k_norm(key)
    query, key = apply_rotary_pos_emb(query, key, cos, sin)
    return query, key, value, None


def _interface(self):
    """The attention function the model's config names."""
    return ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)


def attend(self, query, key, value, attention_mask, rotary, kwargs):
    """The configured attention function on q, k, v as `query_key_value` gave them: [R, W, heads, D] and weights."""
    extra = {} if rotary is None else {"blockdiff_rotary": rotary}
    return _interface(self)(self, query, key, value, attention_mask,
                            dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling,
                            sliding_window=self.sliding_window, **kwargs, **extra)


def output_projection(self, attended: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    return _project(self.o_proj, attended.reshape(*attended.shape[:2], -1).contiguous(), invariant)


def rotates_in_cache_now(self, rotary_in_cache: bool) -> bool:
    """Whether this forward hands q/k to the cache as projected: the attention takes it, and it is hf_blockdiff's."""
    return rotary_in_cache and _interface(self) is blockdiff_attention_forward


def _attention(self, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs,
               rotary_in_cache: bool, invariant: bool):
    cache = kv_cache_argument(past_key_values, kwargs)
    if cache is not None:  # the cache's parameter is the fourth on every version, whatever its name
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, cache, **kwargs)
    query, key, value, rotary = query_key_value(self, hidden_states, position_embeddings,
                                                rotates_in_cache_now(self, rotary_in_cache), invariant)
    attended, weights = attend(self, query, key, value, attention_mask, rotary, kwargs)
    return output_projection(self, attended, invariant), weights


def fused_attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                            invariant=False, **kwargs):
    """q/k/v in one launch, then the stock steps."""
    return _attention(self, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs, False,
                      invariant)


def rotary_in_cache_attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                                      invariant=False, **kwargs):
    """q/k/v in one launch; under hf_blockdiff's attention the q/k norms and the rotary embedding in the cache's
    write kernel (for attentions `_rotates_in_cache` takes, decided before decoding patches any norm)."""
    return _attention(self, hidden_states, position_embeddings, attention_mask, past_key_values, kwargs, True,
                      invariant)


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
    return unhooked(module) and all(plain_linear(p, dtype) for p in linears)


def _fusable_layer(layer: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Exactly a listed decoder layer, unhooked, with stock norms, a fused attention and a fused gated MLP."""
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    return (type(layer) in DECODER_LAYERS and unhooked(layer) and all(type(n) in RMS_NORMS and unhooked(n)
                                                                        for n in norms)
            and type(layer.mlp) in GATED_MLPS and _fusable(layer.mlp, dtype) and _fusable(layer.self_attn, dtype))


def _bound(forward, module: torch.nn.Module, invariant: bool):
    """`forward` as the module's method; `invariant`: called with invariant=True (a new object at each install:
    such layers are never compiled, so no compiled layer guards on it)."""
    if invariant:
        return types.MethodType(functools.partial(forward, invariant=True), module)
    return forward.__get__(module)


def fused_forwards(model: torch.nn.Module, mlps: bool = True, layers: bool = False,
                   invariant: bool = False) -> list[tuple[torch.nn.Module, object]]:
    """(module, forward) for every module to run fused while decoding (none without Triton); `mlps`: the gated MLPs
    too (with many tokens their ops run unfused, where the compiled stock MLP fuses its activation; then an MLP given
    its gate and up stacked runs `stacked_mlp_forward`); `layers`: with `mlps`, the decoder layers too (their residual
    adds fused; for layers that are not compiled); `invariant`: their GEMMs in the batch-invariant launches
    (`RuntimeOptions.batch_invariant`)."""
    dtype = model.dtype
    if not TRITON_AVAILABLE or dtype not in _DTYPES:
        return []
    forwards = []
    for module in model.modules():
        if mlps and layers and _fusable_layer(module, dtype):
            forwards.append((module, _bound(fused_layer_forward, module, invariant)))
        elif _fusable(module, dtype) and (mlps or type(module) not in GATED_MLPS):
            fused = (fused_mlp_forward if type(module) in GATED_MLPS else rotary_in_cache_attention_forward
                     if _rotates_in_cache(module) else fused_attention_forward)
            forwards.append((module, _bound(fused, module, invariant)))
        elif STACKED_GATE_UP in module._parameters and _fusable(module, dtype):
            forwards.append((module, _bound(stacked_mlp_forward, module, invariant)))
    return forwards
