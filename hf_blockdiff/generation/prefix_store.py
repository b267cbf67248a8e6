"""Prompt prefixes kept in the KV cache across calls (`prefix_cache_tokens`; docs/architecture.md, "The cache").

The unit of reuse is `lcm(page_size, block_size)` tokens: under block-causal attention the K/V of the first k units
of a prompt depend only on those k units' tokens (whole blocks, whole pages), so a later prompt that starts with the
same tokens may read them. Each stored unit is keyed by the exact tokens from position 0 to its end and holds its
pages by reference. Least recently used units go first when the store is over its capacity or the pool is short of
pages, and a unit is always used more recently than the units after it (a chain is touched from its end back to
its start), so eviction takes the last units of a chain first and never leaves a unit whose predecessor is gone
in front of it. Any change of the model's weights (seen by `weights_fingerprint`) empties the store.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from ..cache import PagedBlockCache


def weights_fingerprint(model) -> tuple:
    """What identifies the weights the cached K/V came from: per parameter its storage, version counter (in-place
    updates: optimizer steps, load_state_dict) and a strided sample sum (updates through `.data`, LoRA merges)."""
    parts, samples = [], []
    for name, parameter in model.named_parameters():
        parts.append((name, parameter.data_ptr(), parameter._version, tuple(parameter.shape), parameter.dtype))
        flat = parameter.detach().reshape(-1)
        samples.append(flat[:: max(1, flat.numel() // 64)].double().sum())
    return tuple(parts), tuple(torch.stack(samples).tolist()) if samples else ()


class PrefixStore:
    def __init__(self, cache: PagedBlockCache, block_size: int, capacity_tokens: int):
        self.cache = cache
        self.unit = math.lcm(cache.page_size, block_size)
        self.pages_per_unit = self.unit // cache.page_size
        self.units: OrderedDict[bytes, list[int]] = OrderedDict()
        self.fingerprint = None
        self.resize(capacity_tokens)

    def resize(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens // self.unit  # units
        while len(self.units) > self.capacity:
            self.units.popitem(last=False)  # not held now: start_call holds what is left

    def _keys(self, tokens: torch.Tensor, length: int) -> list[bytes]:
        """The keys of the units of `tokens[:length]`, in order: the exact int64 bytes from position 0 to each unit's
        end (the tokens come to the host once, not once per unit)."""
        ends = range(self.unit, length + 1, self.unit)
        if not ends:
            return []
        data = tokens[: ends[-1]].to("cpu", torch.int64).numpy().tobytes()
        return [data[: end * 8] for end in ends]  # 8 bytes per int64 token

    def start_call(self, fingerprint) -> None:
        """The pool was reset: hold the stored pages again, or forget them all if the weights changed."""
        if fingerprint != self.fingerprint:
            self.units.clear()
            self.fingerprint = fingerprint
        for pages in self.units.values():
            self.cache.pages.hold(pages)

    def lookup(self, tokens: torch.Tensor, limit: int) -> list[int]:
        """Pages of the longest stored prefix of `tokens` no longer than `limit` tokens (the caller holds them)."""
        keys = []
        for key in self._keys(tokens, limit):
            if key not in self.units:
                break
            keys.append(key)
        self._touch(keys)
        found = [page for key in keys for page in self.units[key]]
        self.cache.pages.hold(found)
        return found

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # the chain's start ends most recent
            self.units.move_to_end(key)

    def insert(self, tokens: torch.Tensor, row_pages: list[int], length: int) -> None:
        """Store the units of `tokens[:length]` (K/V in `row_pages`, the row's page table) not stored yet."""
        keys = self._keys(tokens, length)
        for index, key in enumerate(keys):
            if key not in self.units:
                pages = row_pages[index * self.pages_per_unit:(index + 1) * self.pages_per_unit]
                self.cache.pages.hold(pages)
                self.units[key] = pages
        self._touch(keys)
        while len(self.units) > self.capacity:
            self.evict()

    def evict(self) -> bool:
        """Let go of the least recently used unit; False when there is none."""
        if not self.units:
            return False
        _, pages = self.units.popitem(last=False)
        self.cache.pages.drop(pages)
        return True
