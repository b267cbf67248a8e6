"""Which KV pages an admitted prompt gets (docs/architecture.md, "The cache").

A prompt takes pages for its canvas (`row_end` tokens) when it is admitted and gives them back when it finishes.
The samples of one prompt (`num_return_sequences`) form a group: the first one admitted computes the prompt's prefix
(everything before its first decode block) and the group keeps that prefix as a `SharedPrefix`; a later sample takes
the prefix's full pages by reference and copies its last, partial page into a page of its own (copy on write at the
prefix boundary: its own decode K/V start inside that page). The prefix lives while a sample of the group holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import PagedBlockCache
from .prefix_store import PrefixStore


@dataclass
class SharedPrefix:
    """A prompt prefix in the cache: `length` tokens, in `pages` (full ones) and `tail` (the page holding the last
    `length % page_size` tokens, or None); `carry` is the hidden state of its last position (logit shift)."""

    length: int
    pages: list[int]
    tail: int | None
    carry: torch.Tensor | None = None
    holders: int = 0

    @property
    def references(self) -> list[int]:
        return self.pages + ([] if self.tail is None else [self.tail])


@dataclass
class Admission:
    """An admitted prompt's prefix: `prefix` is its group's (None: not shared); `reuses` says the prefix was computed
    before (then the row's own first page takes a copy of the prefix's tail page: `copy`, (source, target) or None);
    otherwise this row's prefill computes it from `start` on (the tokens before came from the prefix store)."""

    slot: int
    request: int
    prefix: SharedPrefix | None = None
    reuses: bool = False
    copy: tuple[int, int] | None = None
    start: int = 0


class PageAssigner:
    """Pages for the rows of one engine: `admit` before a prompt enters a slot, `release` when it leaves; `store`
    keeps prompt prefixes across calls (None: off); `logit_shift` keeps the last prefix token computed (its hidden
    state predicts the next token, and the store keeps none)."""

    def __init__(self, cache: PagedBlockCache, rows: int, guided: bool, share: bool, store: PrefixStore | None = None,
                 logit_shift: bool = False):
        self.cache, self.rows, self.guided, self.share = cache, rows, guided, share
        self.store, self.logit_shift = store, logit_shift
        self.prefixes: dict[int, SharedPrefix] = {}  # group -> its prefix in the cache
        self.held: dict[int, int] = {}  # slot -> group whose prefix it holds

    def start_call(self, fingerprint=None) -> None:
        """A new call: every page free but the store's (a call that raised may have left rows and prefixes holding
        some); the store empties if the weights changed since it was filled."""
        self.cache.reset_pages()
        self.prefixes.clear()
        self.held.clear()
        if self.store is not None:
            self.store.start_call(fingerprint)

    def admit(self, slot: int, request: int, group: int, row_end: int, prompt: torch.Tensor,
              prefix_length: int) -> Admission | None:
        """Pages for `request` in `slot` (its group's prefix, or the store's longest match, reused), or None when the
        pool has too few free pages even with the store emptied (the request waits for a slot to finish)."""
        cache, share = self.cache, self.share and prefix_length > 0
        shared = self.prefixes.get(group) if share else None
        stored = []
        if shared is None and self.store is not None:
            stored = self.store.lookup(prompt, prefix_length - int(self.logit_shift))
        first = shared.pages if shared is not None else stored
        count = cache.pages_for(row_end) - len(first)
        own = self._take(count * (2 if self.guided else 1))
        if own is None:
            cache.pages.drop(stored)
            return None
        admission = Admission(slot, request, shared, reuses=shared is not None, start=len(stored) * cache.page_size)
        cache.assign(slot, first + own[:count])
        cache.pages.drop(stored)  # the row holds them now
        if shared is not None:
            admission.copy = None if shared.tail is None else (shared.tail, own[0])
        elif share:
            admission.prefix = self._new_prefix(group, cache.row_pages[slot], prefix_length)
        if self.guided:
            cache.assign(slot + self.rows, own[count:])
        if admission.prefix is not None:
            admission.prefix.holders += 1
            self.held[slot] = group
        return admission

    def _take(self, count: int) -> list[int] | None:
        pages = self.cache.pages.take(count)
        while pages is None and self.store is not None and self.store.evict():
            pages = self.cache.pages.take(count)
        return pages

    def _new_prefix(self, group: int, pages: list[int], length: int) -> SharedPrefix:
        full, rest = divmod(length, self.cache.page_size)
        prefix = SharedPrefix(length, pages[:full], pages[full] if rest else None)
        self.cache.pages.hold(prefix.references)
        self.prefixes[group] = prefix
        return prefix

    def remember(self, admissions: list[Admission], prompts: list[torch.Tensor], prefix_lengths: list[int]) -> None:
        """After the prefill: the prefixes it computed go into the store."""
        if self.store is None:
            return
        for admission, prompt, length in zip(admissions, prompts, prefix_lengths):
            if not admission.reuses:
                self.store.insert(prompt, self.cache.row_pages[admission.slot], length)

    def release(self, slot: int) -> None:
        """`slot`'s prompt finished: its pages go back, and its group's prefix with the group's last holder."""
        self.cache.release(slot)
        if self.guided:
            self.cache.release(slot + self.rows)
        group = self.held.pop(slot, None)
        if group is not None:
            shared = self.prefixes[group]
            shared.holders -= 1
            if shared.holders == 0:
                self.cache.pages.drop(shared.references)
                del self.prefixes[group]
