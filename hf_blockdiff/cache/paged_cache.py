"""`PagedBlockCache`: a paged KV cache for block-diffusion decoding, as a `transformers.Cache` (docs/architecture.md,
"The cache").

Each layer owns a pool of pages (`[num_pages, page_size, kv_heads, head_dim]` for K and for V, allocated at the
first `update` so tensor-parallel shards hold their local heads). Every row has a page table and a committed
length. A forward's `ForwardPlan` (passed to `update` in `cache_kwargs["plan"]`) says where the window's K/V go:
`update` writes them *ahead* of the committed pointer and never moves it; `commit` advances it after a forward that
computed K/V from final tokens. Page 0 is a scratch page that absorbs writes of padding positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache

from ..kernels.rotary_write import rotary_write

SCRATCH_PAGE = 0


@dataclass
class ForwardPlan:
    """What one forward's attention needs, shared by every layer.

    q_limit[r, i]: window query i of row r sees the row's keys at positions [0, q_limit) (block-causal windows give
    every query of a block the end of its block; bidirectional ones the whole canvas). 0 marks padding queries.
    q_start[r, i]: in sliding-window layers the query sees only keys from q_start on (None: the model has none;
    docs/fidelity.md, "DiffusionGemma").
    """

    backend: Any  # the attention backend that planned the forward and attends in it
    q_limit: torch.Tensor  # [R, W] int32
    page_table: torch.Tensor  # [R, pages] int32 page tables of the window rows
    write_slots: torch.Tensor  # [R * W] flat page-pool slots of the window positions
    read_slots: torch.Tensor | None = None  # [R, Lk] slots of the dense key range (sdpa)
    key_lengths: torch.Tensor | None = None  # [R] int32 one key length per row (flash_attn: rows are block chunks)
    q_start: torch.Tensor | None = None  # [R, W] int32 first key of sliding-window layers
    _dense_masks: dict = field(default_factory=dict, repr=False)

    def key_start(self, sliding: bool) -> torch.Tensor | None:
        """The lower key limits of a layer: q_start in sliding-window layers, else none."""
        return self.q_start if sliding else None

    def dense_mask(self, key_length: int, sliding: bool = False) -> torch.Tensor:
        """[R, 1, W, key_length] bool; padding queries see key 0 so no softmax row is empty."""
        mask = self._dense_masks.get(sliding)
        if mask is None or mask.shape[-1] != key_length:
            keys = torch.arange(key_length, device=self.q_limit.device)
            mask = keys < self.q_limit.clamp(min=1)[..., None]
            start = self.key_start(sliding)
            if start is not None:
                mask &= (keys >= start[..., None]) | (self.q_limit[..., None] == 0)
            mask = self._dense_masks[sliding] = mask[:, None]
        return mask


class PagePool:
    """The pages of the pool and their references (rows, and prefixes kept for later calls); a page with none is free.
    Page 0 (scratch) is never handed out. Host-side bookkeeping: page tables carry the result to the device."""

    def __init__(self, num_pages: int):
        self.references = [0] * num_pages
        self.free = set(range(SCRATCH_PAGE + 1, num_pages))
        self.peak = 0

    @property
    def in_use(self) -> int:
        return len(self.references) - 1 - len(self.free)

    def take(self, count: int) -> list[int] | None:
        """`count` free pages (not yet referenced), or None when fewer are free."""
        if count > len(self.free):
            return None
        taken = [self.free.pop() for _ in range(count)]
        self.peak = max(self.peak, self.in_use)
        return taken

    def hold(self, pages: list[int]) -> None:
        """One more reference to each page (a free page is claimed: a prefix kept across a reset of the pool)."""
        for page in pages:
            self.free.discard(page)
            self.references[page] += 1

    def drop(self, pages: list[int]) -> None:
        for page in pages:
            self.references[page] -= 1
            if self.references[page] == 0:
                self.free.add(page)


class PagedBlockCache(Cache):
    def __init__(self, num_layers: int, page_size: int = 64):
        super().__init__(layers=[])
        self.num_layers = num_layers
        self.page_size = page_size
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.num_pages = 0
        self.page_table = torch.zeros(0, 0, dtype=torch.int32)
        self.committed = torch.zeros(0, dtype=torch.long)

    # -- rows and pages ---------------------------------------------------------------------------------------

    def start(self, num_rows: int, row_capacity: int, pool_tokens: int, device: torch.device) -> None:
        """Begin a call with `num_rows` rows of up to `row_capacity` tokens each and a pool of `pool_tokens` tokens
        (rounded up to pages); every row holds no page until `assign` gives it some."""
        pool = 1 + math.ceil(pool_tokens / self.page_size)
        if pool > self.num_pages:  # a larger pool keeps what the pages hold (a prefix store's K/V)
            for pools in (self.keys, self.values):
                for layer, old in enumerate(pools):
                    if old is not None:
                        pools[layer] = torch.cat([old, old.new_zeros((pool - self.num_pages, *old.shape[1:]))])
            self.num_pages = pool
        self.row_pages: list[list[int]] = [[] for _ in range(num_rows)]
        self.page_table = torch.zeros((num_rows, max(self.pages_for(row_capacity), 1)), dtype=torch.int32,
                                      device=device)
        self.committed = torch.zeros(num_rows, dtype=torch.long, device=device)
        self.reset_pages()

    def reset_pages(self) -> None:
        """Every page free, no row holding any."""
        self.pages = PagePool(self.num_pages)
        self.row_pages = [[] for _ in self.row_pages]
        self.page_table.fill_(SCRATCH_PAGE)

    def pages_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.page_size)

    def assign(self, row: int, pages: list[int]) -> None:
        """Row `row` starts a new prompt on `pages` (its page table, in order; the row takes a reference to each):
        nothing of it is committed. Its previous pages are released first."""
        self.release(row)
        self.pages.hold(pages)
        self.row_pages[row] = list(pages)
        table = torch.full((self.page_table.shape[1],), SCRATCH_PAGE, dtype=torch.int32)
        table[: len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.page_table[row] = table.to(self.page_table.device)
        self.committed[row] = 0

    def release(self, row: int) -> None:
        """Row `row` lets go of its pages (a page returns to the pool with its last reference)."""
        self.pages.drop(self.row_pages[row])
        self.row_pages[row] = []

    def copy_page(self, source: int, target: int) -> None:
        """Copy the K/V of page `source` into page `target` in every layer (a shared prefix ending inside a page
        continues in a page of the row's own: copy on write at the prefix boundary)."""
        for pool in (*self.keys, *self.values):
            if pool is not None:
                pool[target].copy_(pool[source])

    def commit(self, rows: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Advance the committed pointer of `rows` by `num_tokens` (written by the last forward)."""
        self.committed.index_add_(0, rows, num_tokens)

    def slots(self, rows: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Flat pool slots of token `positions` ([R, X]) of `rows`; invalid positions map to the scratch page."""
        page_index = (positions // self.page_size).clamp(0, self.page_table.shape[1] - 1)
        pages = self.page_table[rows[:, None], page_index].long()
        slots = pages * self.page_size + positions % self.page_size
        return torch.where(valid, slots, SCRATCH_PAGE * self.page_size)

    # -- transformers.Cache API ---------------------------------------------------------------------------------

    def _pools(self, layer_idx: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V page pools, allocated at its first write from K/V `like` [R, kv_heads, W, head_dim]."""
        if self.keys[layer_idx] is None:
            shape = (self.num_pages, self.page_size, like.shape[1], like.shape[3])
            self.keys[layer_idx], self.values[layer_idx] = like.new_zeros(shape), like.new_zeros(shape)
        return self.keys[layer_idx], self.values[layer_idx]

    def _read(self, layer_idx: int, plan: ForwardPlan, key_states, value_states):
        """What the plan's backend reads: the dense key range when the plan has read slots (sdpa), else the given."""
        if plan.read_slots is None:
            return key_states, value_states
        return self.dense(layer_idx, plan.read_slots)

    @torch.compiler.disable
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict | None = None):
        """Write the window's K/V where `cache_kwargs["plan"]` says; returns what its backend reads: the dense key
        range when the plan has read slots (sdpa), else the window's own K/V."""
        plan = cache_kwargs["plan"]
        for pool, states in zip(self._pools(layer_idx, key_states), (key_states, value_states)):
            flat = pool.view(-1, *pool.shape[2:])
            flat.index_copy_(0, plan.write_slots, states.transpose(1, 2).reshape(-1, *flat.shape[1:]))
        return self._read(layer_idx, plan, key_states, value_states)

    @torch.compiler.disable
    def update_rotary(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                      plan: ForwardPlan, rotary: tuple):
        """`update` for K/V as projected, before the q/k RMSNorms and the rotary embedding (`rotary`: cos, sin
        [R, W, D], the norms' weights or None, eps), which `kernels.rotary_write` applies while writing; query, key and
        value are [R, heads, W, D] views of [R, W, heads, D] projections. Returns the rotated queries and what the
        backend reads (the dense key range, or None for backends that read the pools)."""
        cos, sin, q_weight, k_weight, eps = rotary
        key_pages, value_pages = self._pools(layer_idx, key)
        rows, heads, width, dim = query.shape
        cos, sin = (t.expand(rows, width, dim).reshape(-1, dim) for t in (cos, sin))  # positions may be broadcast
        rotated = rotary_write(*(t.transpose(1, 2).reshape(rows * width, -1, dim) for t in (query, key, value)),
                               cos, sin, key_pages, value_pages, plan.write_slots, q_weight, k_weight, eps)
        return (rotated.view(rows, width, heads, dim).transpose(1, 2), *self._read(layer_idx, plan, None, None))

    def dense(self, layer_idx: int, read_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `read_slots` as [R, kv_heads, Lk, head_dim]."""
        out = []
        for pool in (self.keys[layer_idx], self.values[layer_idx]):
            flat = pool.view(-1, *pool.shape[2:])
            out.append(flat[read_slots].transpose(1, 2))
        return out[0], out[1]

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        return int(self.committed.max()) if self.committed.numel() else 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.page_table.shape[1] * self.page_size

    def crop(self, max_length: int) -> None:
        """Drop the last `-max_length` committed tokens of every row (negative lengths only)."""
        if max_length >= 0:
            raise ValueError("PagedBlockCache.crop takes a negative length: the number of tokens to drop, negated.")
        self.committed = (self.committed + max_length).clamp(min=0)

    def reset(self) -> None:
        self.committed.zero_()

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return any(k is not None for k in self.keys)

    @property
    def fully_allocated(self) -> bool:
        """Whether every layer's page pools exist (each is allocated, zeroed, at its layer's first write)."""
        return all(k is not None for k in self.keys)
