"""Compiled decoder layers in two regions around their attention, for the Qwen-style layers whose attention runs
fused (`fusion/layers.py`): `before_attention` (input RMSNorm, q/k/v, and the q/k norms and rotary embedding unless
the cache's write kernel applies them) and `after_attention` (output projection, residual, post-attention RMSNorm,
MLP, residual), each traced whole by torch.compile, with the cache write and the attention eager between them.

The stock layer compiled whole breaks its graph inside the attention, calls below the layer: dynamo then traces the
layer again up to the call, then each function down to the attention call, and resumes each one, five frames or
more and several passes over the ops before the attention. Two regions are two frames traced once each, the same
graphs (docs/benchmarks.md, "Eval loops"). Other layers compile whole (`mode.compiled_forward`).
"""

from __future__ import annotations

import functools

import torch

from ..cache.keyword import kv_cache_argument
from .layers import DECODER_LAYERS, attend, output_projection, query_key_value, rotates_in_cache_now, unhooked


def before_attention(layer, hidden_states, position_embeddings, rotary_in_cache: bool):
    return query_key_value(layer.self_attn, layer.input_layernorm(hidden_states), position_embeddings,
                           rotary_in_cache)


def after_attention(layer, attended, residual):
    hidden_states = residual + output_projection(layer.self_attn, attended)
    return hidden_states + layer.mlp(layer.post_attention_layernorm(hidden_states))


@functools.cache
def compiled_regions(dynamic: bool | None):
    """The two regions through torch.compile, shared by every layer (its weights are the graphs' inputs)."""
    return (torch.compile(before_attention, dynamic=dynamic, fullgraph=True),
            torch.compile(after_attention, dynamic=dynamic, fullgraph=True))


def in_regions(layer: torch.nn.Module, fused_attention: bool) -> bool:
    """Whether the layer compiles as two regions: a listed decoder layer (whose forward is the one `regions_forward`
    runs), unhooked, whose attention runs fused."""
    return fused_attention and type(layer) in DECODER_LAYERS and unhooked(layer)


def regions_forward(layer: torch.nn.Module, dynamic: bool | None, rotary_in_cache: bool):
    """The layer's forward as the compiled regions and the eager attention between them; `rotary_in_cache`: its
    attention's fused forward hands q/k to the cache as projected (`fusion.layers._rotates_in_cache`)."""
    before, after = compiled_regions(dynamic)

    def forward(hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        cache = kv_cache_argument(past_key_values, kwargs)
        if cache is not None:  # a transformers cache: the stock layer
            return type(layer).forward(layer, hidden_states, attention_mask, position_ids, cache, use_cache,
                                       position_embeddings, **kwargs)
        attention = layer.self_attn
        query, key, value, rotary = before(layer, hidden_states, position_embeddings,
                                           rotates_in_cache_now(attention, rotary_in_cache))
        attended, _ = attend(attention, query, key, value, attention_mask, rotary, kwargs)
        return after(layer, attended, hidden_states)

    return forward
