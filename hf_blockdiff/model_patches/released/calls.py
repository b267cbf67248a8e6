"""The cache keyword arguments of the released generate scripts, per family, turned into what one forward does.

Each `*_call(config, past_key_values, use_cache, query_length, kwargs)` pops its family's released keywords from
`kwargs` (everything else stays there and reaches the attention function unchanged) and returns a `ReleasedCall`.
Without those keywords every family behaves as transformers does: a given cache gets the new keys and values appended.
A list of per-layer `(keys, values)` (what `ReleasedCache` indexes to) is accepted as `past_key_values`, and
`use_cache=True` without a cache starts a `ReleasedCache`.

- SDAR, SDAR-MoE (`generate.py`): `store_kv=False` attends to the cache without writing to it.
- LLaDA, Dream (Fast-dLLM v1 `generate.py`, `generation_utils_block.py`): `replace_position`, a [batch, length]
  0/1 tensor marking where the new tokens sit inside the cache (Dream: with `dual_cache=True`), overwrites those
  cached positions and attends to the whole cache. The marked span must be contiguous, as long as the input, and
  the same in every row (the released code assumes it and computes the positions from its end).
- Fast-dLLM v2 (`generation_functions.py`): `update_past_key_values`, `use_block_cache`, `block_past_key_values`,
  `replace_position` (an int: the sub-block's offset in the block) and `block_size` (must be the checkpoint's
  `bd_size`). The released default of `update_past_key_values` is False; here an absent value keeps transformers'
  behaviour (the scripts always pass it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from ...cache.keyword import CACHE_KEYWORD
from .caches import FlatReleasedCache, ReleasedCache, block_view, read_only_view, replacing_view


@dataclass
class BlockCacheModelOutput(BaseModelOutputWithPast):
    block_past_key_values: Cache | None = None


@dataclass
class BlockCacheCausalLMOutput(CausalLMOutputWithPast):
    block_past_key_values: Cache | None = None


@dataclass
class ReleasedCall:
    """How one forward uses its cache: `layers_cache` is what the attention layers update (possibly a view), `kept`
    the caller's cache, which the output returns; `query_offset` the position of the first query when the call
    implies it (None: right after the cache); `block_cache` Fast-dLLM v2's block cache, returned as
    `block_past_key_values`."""

    layers_cache: Cache | None
    kept: Cache | None
    query_offset: int | None = None
    block_cache: Cache | None = None

    def position_ids(self, query_length: int, device: torch.device) -> torch.Tensor:
        start = self.query_offset
        if start is None:
            start = self.layers_cache.get_seq_length() if self.layers_cache is not None else 0
        return torch.arange(start, start + query_length, device=device)[None]

    def finish(self, output: BaseModelOutputWithPast) -> BaseModelOutputWithPast:
        if getattr(output, CACHE_KEYWORD) is not None:
            output[CACHE_KEYWORD] = self.kept
        if self.block_cache is None:
            return output
        return BlockCacheModelOutput(**output, block_past_key_values=self.block_cache)


def plain_call(config, past_key_values, use_cache, query_length, kwargs, cache_class=ReleasedCache) -> ReleasedCall:
    """No released keyword: a released tuple list becomes a `cache_class`, `use_cache=True` alone starts one."""
    cache = past_key_values
    if isinstance(cache, (list, tuple)):
        cache = cache_class.from_released(cache, config)
    elif cache is None and use_cache:
        cache = cache_class(config=config)
    return ReleasedCall(cache, cache)


def _through_view(call: ReleasedCall, view) -> ReleasedCall:
    return replace(call, layers_cache=view, query_offset=view.query_offset)


def sdar_call(config, past_key_values, use_cache, query_length, kwargs) -> ReleasedCall:
    call = plain_call(config, past_key_values, use_cache, query_length, kwargs)
    if kwargs.pop("store_kv", None) is False and call.kept is not None:
        return _through_view(call, read_only_view(call.kept, config.num_hidden_layers))
    return call


def replaced_span_start(replace_position: torch.Tensor, query_length: int) -> int:
    """Start of the one contiguous span of `query_length` positions marked in every row of `replace_position`."""
    marked = replace_position.bool()
    found = marked[0].nonzero()
    start = int(found[0]) if len(found) else 0
    expected = torch.zeros_like(marked[0])
    expected[start:start + query_length] = True
    if len(found) != query_length or not bool((marked == expected).all()):
        raise ValueError(
            f"replace_position must mark one contiguous span of {query_length} positions (the input's length), the "
            "same in every row."
        )
    return start


def dual_cache_call(config, past_key_values, use_cache, query_length, kwargs, cache_class=ReleasedCache):
    """LLaDA's (and under `dream_call`, Dream's): Fast-dLLM v1's `replace_position`. The LLaDA remote code's
    `attention_bias` is refused (pass a boolean [b, 1, q, k] `attention_mask`)."""
    if kwargs.pop("attention_bias", None) is not None:
        raise ValueError("attention_bias is not supported: pass a boolean [b, 1, q, k] attention_mask instead.")
    replace_position = kwargs.pop("replace_position", None)
    call = plain_call(config, past_key_values, use_cache, query_length, kwargs, cache_class)
    if replace_position is None:
        return call
    if call.kept is None:
        raise ValueError("replace_position (Fast-dLLM's dual cache) needs past_key_values.")
    start = replaced_span_start(replace_position, query_length)
    return _through_view(call, replacing_view(call.kept, config.num_hidden_layers, start))


def dream_call(config, past_key_values, use_cache, query_length, kwargs) -> ReleasedCall:
    """Dream's: Fast-dLLM v1's `dual_cache=True` with `replace_position`, cache tuples [batch, length, width]."""
    if bool(kwargs.pop("dual_cache", False)) != (kwargs.get("replace_position") is not None):
        raise ValueError("Fast-dLLM's Dream dual cache takes dual_cache=True together with replace_position.")
    return dual_cache_call(config, past_key_values, use_cache, query_length, kwargs, FlatReleasedCache)


def block_cache_for(config, kwargs) -> Cache | None:
    """Fast-dLLM v2's block cache of this forward: the given one, or a new one with `use_block_cache=True` (put in
    `kwargs`, so that the causal LM and its decoder share it)."""
    if kwargs.get("use_block_cache") and kwargs.get("block_past_key_values") is None:
        kwargs["block_past_key_values"] = ReleasedCache(config=config)
    return kwargs.get("block_past_key_values")


def fast_dllm_v2_call(config, past_key_values, use_cache, query_length, kwargs) -> ReleasedCall:
    block_size = kwargs.pop("block_size", None)
    if block_size is not None and block_size != config.bd_size:
        raise ValueError(f"block_size={block_size} differs from the checkpoint's bd_size={config.bd_size}: "
                         "the attention follows bd_size.")
    block_cache = block_cache_for(config, kwargs)
    for name in ("use_block_cache", "block_past_key_values"):
        kwargs.pop(name, None)
    keep = kwargs.pop("update_past_key_values", None) is not False
    start = kwargs.pop("replace_position", None)
    call = plain_call(config, past_key_values, use_cache, query_length, kwargs)
    if block_cache is not None:
        if call.kept is None:
            raise ValueError("Fast-dLLM v2's block cache needs use_cache=True or past_key_values.")
        view = block_view(call.kept, block_cache, config.num_hidden_layers, start or 0, keep)
        return replace(_through_view(call, view), block_cache=block_cache)
    if start is not None:
        raise ValueError("Fast-dLLM v2's replace_position needs use_block_cache=True or block_past_key_values.")
    if not keep and call.kept is not None:
        return _through_view(call, read_only_view(call.kept, config.num_hidden_layers))
    return call
