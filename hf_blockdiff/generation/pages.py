"""Which KV pages an admitted prompt gets (docs/design.md, "The cache").

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
    otherwise this row's prefill computes it."""

    slot: int
    request: int
    prefix: SharedPrefix | None = None
    reuses: bool = False
    copy: tuple[int, int] | None = None


class PageAssigner:
    """Pages for the rows of one engine: `admit` before a prompt enters a slot, `release` when it leaves."""

    def __init__(self, cache: PagedBlockCache, rows: int, guided: bool, share: bool):
        self.cache, self.rows, self.guided, self.share = cache, rows, guided, share
        self.prefixes: dict[int, SharedPrefix] = {}  # group -> its prefix in the cache
        self.held: dict[int, int] = {}  # slot -> group whose prefix it holds

    def start_call(self) -> None:
        """A new call: every page free (a call that raised may have left rows and prefixes holding some)."""
        self.cache.reset_pages()
        self.prefixes.clear()
        self.held.clear()

    def admit(self, slot: int, request: int, group: int, row_end: int, prefix_length: int) -> Admission | None:
        """Pages for `request` in `slot` (its group's prefix reused when there is one), or None when the pool has too
        few free pages (the request waits for a slot to finish)."""
        cache, share = self.cache, self.share and prefix_length > 0
        shared = self.prefixes.get(group) if share else None
        count = cache.pages_for(row_end) - (len(shared.pages) if shared is not None else 0)
        own = cache.pages.take(count * (2 if self.guided else 1))
        if own is None:
            return None
        admission = Admission(slot, request, shared, reuses=shared is not None)
        if shared is not None:
            cache.assign(slot, shared.pages + own[:count])
            admission.copy = None if shared.tail is None else (shared.tail, own[0])
        else:
            cache.assign(slot, own[:count])
            if share:
                full, rest = divmod(prefix_length, cache.page_size)
                admission.prefix = SharedPrefix(prefix_length, own[:full], own[full] if rest else None)
                cache.pages.hold(admission.prefix.references)
                self.prefixes[group] = admission.prefix
        if self.guided:
            cache.assign(slot + self.rows, own[count:])
        if admission.prefix is not None:
            admission.prefix.holders += 1
            self.held[slot] = group
        return admission

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
