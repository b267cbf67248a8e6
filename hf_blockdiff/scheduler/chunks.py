"""Chunks: how a forward lays the slots' windows out as rows of the model's batch.

Each slot's window is a span of canvas positions `[start, end)` (possibly empty). The spans are cut into chunks of
`size` tokens and every chunk becomes one row of the forward's `[chunks, size]` input (a virtual row): the model's
dense layers see tokens, and attention reads every chunk's keys from its slot's pages under per-query limits, so a
slot's chunks see each other exactly as one long row would. No padding to the longest window is needed, and with a
fixed `capacity` the shapes are static (chunks past the real ones are padding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Chunks:
    size: int
    rows: torch.Tensor  # [N] slot of each chunk
    positions: torch.Tensor  # [N, size] canvas positions
    valid: torch.Tensor  # [N, size] inside the slot's span (padding chunks: all False)
    first: torch.Tensor  # [R] index of each slot's first chunk
    start: torch.Tensor  # [R] span start of each slot
    end: torch.Tensor  # [R] span end of each slot

    @property
    def count(self) -> int:
        return self.rows.shape[0]

    def locate(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Index into the flattened [N * size] outputs of (slot, position) pairs, and whether the position was in
        the forward."""
        start, end = self.start[rows], self.end[rows]
        if positions.dim() > rows.dim():
            start, end = start.view(*rows.shape, 1), end.view(*rows.shape, 1)
        offset = positions - start
        first = self.first[rows].view(start.shape)
        index = (first + offset.div(self.size, rounding_mode="floor")) * self.size + offset % self.size
        inside = (positions >= start) & (positions < end)
        return torch.where(inside, index, 0).clamp(0, self.count * self.size - 1), inside


LEAST_CHUNKS = 2  # torch.compile specializes a size of 1: compiled layers meeting a forward of one chunk recompile


def plan_chunks(start: torch.Tensor, end: torch.Tensor, size: int, capacity: int | None = None) -> Chunks:
    """Cut each slot's span [start, end) into chunks of `size`; `capacity` fixes the number of chunks (static shapes,
    no host sync; it must cover the spans), None uses as many as needed, and at least `LEAST_CHUNKS`: a prefill of
    one admitted row's prompt or a step of one row left would otherwise recompile compiled layers mid-call
    (automatic-dynamic shapes assume sizes of at least 2; one recompile held a served batch for 4 s on an H200)."""
    lengths = (end - start).clamp(min=0)
    counts = (lengths + size - 1) // size
    cumulative = counts.cumsum(0)
    first = cumulative - counts
    total = max(int(cumulative[-1]), LEAST_CHUNKS) if capacity is None else capacity
    chunk = torch.arange(max(total, 1), device=start.device)
    rows = torch.searchsorted(cumulative, chunk, right=True).clamp(max=len(start) - 1)
    real = chunk < cumulative[-1]
    positions = start[rows, None] + (chunk - first[rows])[:, None] * size + torch.arange(size, device=start.device)
    valid = real[:, None] & (positions < end[rows, None])
    return Chunks(size, rows, positions, valid, first, start, end)
