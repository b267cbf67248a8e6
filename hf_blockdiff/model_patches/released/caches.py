"""KV caches for the released call forms: a cache that also reads as the released per-layer tuples, and per-forward
views of a cache for the released cache contracts that are not transformers' "append the new keys and values".

- SDAR's `store_kv=False` and Fast-dLLM v2's `update_past_key_values=False` attend to the cached keys and the new
  ones but keep nothing (`read_only_view`).
- Fast-dLLM v1's dual cache (`replace_position`) writes the new keys and values over their positions inside the cache,
  in place, and attends to the whole cache (`replacing_view`).
- Fast-dLLM v2's block cache holds the current block: filled by the first forward of the block, then a sub-block's
  keys and values overwrite their positions in it, and the whole block meets the prefix cache (`block_view`).

Keys are kept after RoPE, as transformers caches keep them, where the remote code keeps them before RoPE: the tuples
we hand out are for our classes, not for the remote code.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer


class _LayerTensors:
    """`cache.key_cache` / `cache.value_cache`: the per-layer key (or value) tensors as a list, assignable."""

    def __init__(self, cache: Cache, name: str):
        self.cache, self.name = cache, name

    def __len__(self) -> int:
        return len(self.cache.layers)

    def __getitem__(self, layer_idx: int) -> torch.Tensor:
        return getattr(self.cache.layers[layer_idx], self.name)

    def __setitem__(self, layer_idx: int, states: torch.Tensor) -> None:
        setattr(self.cache.layers[layer_idx], self.name, states)


class ReleasedCache(DynamicCache):
    """transformers' `DynamicCache` that also reads like the list of per-layer `(keys, values)` the released code
    returns: `len(cache)` and `cache[layer]` (Fast-dLLM v1 slices those tuples to a prefix and passes the list back,
    see `from_released`), and `cache.key_cache[layer]` / `cache.value_cache[layer]`, which Fast-dLLM v2's
    `batch_sample` reassigns to drop finished rows. Tensors are [batch, kv_heads, length, head_dim]."""

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        return self.to_released(layer.keys), self.to_released(layer.values)

    @property
    def key_cache(self) -> _LayerTensors:
        return _LayerTensors(self, "keys")

    @property
    def value_cache(self) -> _LayerTensors:
        return _LayerTensors(self, "values")

    @staticmethod
    def to_released(states: torch.Tensor) -> torch.Tensor:
        return states

    @staticmethod
    def from_released_layout(states: torch.Tensor, config) -> torch.Tensor:
        if states.dim() != 4:
            raise ValueError(f"Cached keys/values must be [batch, kv_heads, length, head_dim]: {tuple(states.shape)}.")
        return states

    @classmethod
    def from_released(cls, layers_kv, config) -> ReleasedCache:
        """A cache holding the per-layer `(keys, values)` of a list such as `cache[i]` gives (copied, as the released
        code concatenates them)."""
        if len(layers_kv) != config.num_hidden_layers:
            raise ValueError(f"past_key_values holds {len(layers_kv)} layers, the model {config.num_hidden_layers}.")
        cache = cls(config=config)
        for layer, (keys, values) in zip(cache.layers, layers_kv):
            layer.update(cls.from_released_layout(keys, config), cls.from_released_layout(values, config))
        return cache


class FlatReleasedCache(ReleasedCache):
    """Dream's: the cache tuples of Fast-dLLM v1's Dream are [batch, length, kv_heads * head_dim] (its generate code
    slices them on dim 1)."""

    @staticmethod
    def to_released(states: torch.Tensor) -> torch.Tensor:
        return states.transpose(1, 2).flatten(2)

    @staticmethod
    def from_released_layout(states: torch.Tensor, config) -> torch.Tensor:
        if states.dim() != 3:
            raise ValueError(f"Dream's cached keys/values must be [batch, length, width], got {tuple(states.shape)}.")
        return states.unflatten(-1, (config.num_key_value_heads, -1)).transpose(1, 2)


class _ReadOnlyLayer(DynamicLayer):
    """The new keys and values are attended to after the cached ones and not kept."""

    def __init__(self, cached: DynamicLayer):
        super().__init__()
        self.cached = cached

    def update(self, keys, values, *args, **kwargs):
        if self.cached.get_seq_length() == 0:
            return keys, values
        return torch.cat([self.cached.keys, keys], dim=-2), torch.cat([self.cached.values, values], dim=-2)

    def get_seq_length(self) -> int:
        return self.cached.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cached.get_seq_length() + query_length, 0


class _ReplacingLayer(DynamicLayer):
    """The new keys and values overwrite cached positions [start, start + q) in place; all cached ones are attended."""

    def __init__(self, cached: DynamicLayer, start: int):
        super().__init__()
        self.cached, self.start = cached, start

    def update(self, keys, values, *args, **kwargs):
        end = self.start + keys.shape[-2]
        if end > self.cached.get_seq_length():
            raise ValueError(f"Cannot replace cached positions {self.start}..{end - 1}: the cache holds "
                             f"{self.cached.get_seq_length()}.")
        self.cached.keys[..., self.start:end, :] = keys
        self.cached.values[..., self.start:end, :] = values
        return self.cached.keys, self.cached.values

    def get_seq_length(self) -> int:
        return self.cached.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cached.get_seq_length(), 0


class _ThroughBlockLayer(DynamicLayer):
    """Fast-dLLM v2's block cache before the prefix cache: the new keys and values go into `block` (a layer that
    appends, or a `_ReplacingLayer`), and the whole block's then go through `prefix` (kept or `_ReadOnlyLayer`)."""

    def __init__(self, block: DynamicLayer, prefix: DynamicLayer):
        super().__init__()
        self.block, self.prefix = block, prefix

    def update(self, keys, values, *args, **kwargs):
        return self.prefix.update(*self.block.update(keys, values))

    def get_seq_length(self) -> int:
        return self.prefix.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.prefix.get_mask_sizes(self.block.get_mask_sizes(query_length)[0])


class CacheView(Cache):
    """A cache seen through per-layer views for one forward; `query_offset` is the position of its first query."""

    def __init__(self, layers: list[DynamicLayer], query_offset: int):
        super().__init__(layers=layers)
        self.query_offset = query_offset

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.query_offset


def cache_layers(cache: Cache, count: int) -> list:
    """The first `count` layers of `cache`, created now where a lazily filled `DynamicCache` lacks them."""
    while len(cache.layers) < count:
        if cache.layer_class_to_replicate is None:
            raise ValueError(f"The cache has {len(cache.layers)} layers, the model {count}.")
        cache.layers.append(cache.layer_class_to_replicate())
    return cache.layers[:count]


def read_only_view(cache: Cache, count: int) -> CacheView:
    return CacheView([_ReadOnlyLayer(layer) for layer in cache_layers(cache, count)], cache.get_seq_length())


def replacing_view(cache: Cache, count: int, start: int) -> CacheView:
    return CacheView([_ReplacingLayer(layer, start) for layer in cache_layers(cache, count)], start)


def block_view(cache: Cache, block_cache: Cache, count: int, start: int, keep: bool) -> CacheView:
    """Queries at `start` inside the block after `cache`'s prefix; `keep`: the prefix cache stores the block."""
    filled = block_cache.get_seq_length() > 0
    layers = [
        _ThroughBlockLayer(_ReplacingLayer(block, start) if filled else block,
                           prefix if keep else _ReadOnlyLayer(prefix))
        for block, prefix in zip(cache_layers(block_cache, count), cache_layers(cache, count))
    ]
    return CacheView(layers, cache.get_seq_length() + start)
