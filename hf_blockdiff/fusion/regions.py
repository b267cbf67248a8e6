"""Compiled decoder layers in two regions around their attention, for the Qwen-style layers whose attention runs
fused (`fusion/layers.py`): `before_attention` (input RMSNorm, q/k/v, and the q/k norms and rotary embedding unless
the cache's write kernel applies them) and `after_attention` (output projection, residual, post-attention RMSNorm,
MLP, residual), each through torch.compile, with the cache write and the attention eager between them.

The stock layer compiled whole breaks its graph inside the attention, calls below the layer: dynamo then traces the
layer again up to the call, then each function down to the attention call, and resumes each one, five frames or
more and several passes over the ops before the attention. The two regions are two frames for the same graphs
(docs/benchmarks.md, "Eval loops"). They are not compiled with `fullgraph=True`: an MLP that breaks a graph (stock
experts where the experts op does not run) splits its region, and past dynamo's recompile limit (the regions' code
is shared by every layer class and width in the process) a region runs eager with dynamo's warning, as a whole
layer did. Other layers compile whole (`mode.compiled_forward`).

Where the user names a compile cache, the regions of a one-GPU model are compiled ahead of time into its `regions/`
(`fusion/ahead_of_time.py`), traced whole with rows and tokens as symbols, and a later process loads them instead of
tracing them (docs/benchmarks.md, "Eval loops"). With the compile worker on (`compile_cache.load`), a cold process runs
them eager (the functions below, uncompiled) while the worker compiles them: its forwards until then round as eager
torch ops do, not as inductor's fused kernels (bf16 tokens may differ at near-ties; fp32 agrees to rounding). An
artifact's key names what its dropped guards would have checked: the forward installed on each of the layer's modules
(the fused forwards, the experts op) and the hooks that run. A region that cannot be traced whole there (stock experts)
warns once and compiles in each process.
"""

from __future__ import annotations

import functools

import torch

from .ahead_of_time import EAGER, AheadOfTime
from .layers import (
    DECODER_LAYERS, attend, attention_residual_norm, mlp_residual, query_key_value, rotates_in_cache_now,
    stock_with_cache, unhooked,
)


def before_attention(layer, hidden_states, position_embeddings, rotary_in_cache: bool):
    return query_key_value(layer.self_attn, layer.input_layernorm(hidden_states), position_embeddings,
                           rotary_in_cache)


def after_attention(layer, attended, residual):
    hidden_states, normed = attention_residual_norm(layer.self_attn, attended, residual,
                                                    layer.post_attention_layernorm)
    return mlp_residual(layer.mlp, normed, hidden_states)


@functools.cache
def compiled_regions(dynamic: bool | None):
    """The two regions through torch.compile, shared by every layer (its weights are the graphs' inputs)."""
    return torch.compile(before_attention, dynamic=dynamic), torch.compile(after_attention, dynamic=dynamic)


def _name(function) -> str | None:
    """A function's (a bound method's, a partial's) or a callable object's class's qualified name: the same in every
    process."""
    if function is None:
        return None
    function = getattr(function, "__func__", function)
    function = function.func if isinstance(function, functools.partial) else function
    named = function if hasattr(function, "__qualname__") else type(function)
    return f"{named.__module__}.{named.__qualname__}"


def artifact_key(layer: torch.nn.Module) -> str:
    """What an artifact of the layer's regions drops and was traced for: the forward set on each of its modules while
    decoding (stock or skinny MLP, the experts op), their hooks and the process's global module hooks, by name."""
    hooks = (torch.nn.modules.module._global_forward_pre_hooks, torch.nn.modules.module._global_forward_hooks)
    return repr(tuple((_name(type(m)), _name(vars(m).get("forward")),
                       tuple(map(_name, [*m._forward_pre_hooks.values(), *m._forward_hooks.values()])))
                      for m in layer.modules()) + tuple(_name(hook) for table in hooks for hook in table.values()))


REGIONS = (before_attention, after_attention)
AHEAD_OF_TIME = [AheadOfTime(region.__name__, region, "regions", globals(), in_worker=True) for region in REGIONS]


def _loaded_first(ahead: AheadOfTime, compiled, key):
    """The region as loaded from (or compiled ahead of time into) the compile cache, else as torch.compile runs it;
    eager while the compile worker compiles it."""
    def region(layer, *args):
        saved = ahead.variant(key(layer), (layer, *args), {})
        if saved is EAGER:
            return ahead.function(layer, *args)
        return (compiled if saved is None else saved)(layer, *args)

    return region


def in_regions(layer: torch.nn.Module, fused_attention: bool, invariant: bool) -> bool:
    """Whether the layer compiles as two regions: a listed decoder layer (whose forward is the one `regions_forward`
    runs), unhooked, whose attention runs fused, outside the batch-invariant mode (whose GEMMs the regions do not
    launch)."""
    return fused_attention and not invariant and type(layer) in DECODER_LAYERS and unhooked(layer)


def regions_forward(layer: torch.nn.Module, dynamic: bool | None, rotary_in_cache: bool, ahead_of_time: bool):
    """The layer's forward as the compiled regions and the eager attention between them; `rotary_in_cache`: its
    attention's fused forward hands q/k to the cache as projected (`fusion.layers._rotates_in_cache`);
    `ahead_of_time`: the regions loaded from a compile cache where one is named (one GPU: no collective in them)."""
    before, after = compiled_regions(dynamic)
    if ahead_of_time:
        layer_key = functools.cache(artifact_key)  # once a forward (the forwards set on its modules are this forward's)
        before, after = (_loaded_first(ahead, compiled, layer_key)
                         for ahead, compiled in zip(AHEAD_OF_TIME, (before, after)))

    def forward(hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        stock = stock_with_cache(layer, hidden_states, attention_mask, position_ids, past_key_values, use_cache,
                                 position_embeddings, kwargs)
        if stock is not None:
            return stock
        attention = layer.self_attn
        query, key, value, rotary = before(layer, hidden_states, position_embeddings,
                                           rotates_in_cache_now(attention, rotary_in_cache))
        # what the stock layer hands its attention, which passes it on to the attention function
        kwargs.update(position_ids=position_ids, use_cache=use_cache)
        attended, _ = attend(attention, query, key, value, attention_mask, rotary, kwargs)
        return after(layer, attended, hidden_states)

    return forward
