"""Per-call decode state: every row's canvas and the block state machine of DESIGN §3, as tensors.

Rows are kept in their own coordinates (position 0 = the row's first prompt token, whatever the left padding), so
a row decodes the same alone or in any batch. Decode block j of row r covers
`[first_block_start[r] + j·B, … + B)` clipped to `row_end[r]`: for `absolute` alignment blocks sit at multiples of B
and the first one holds the prompt tail; for `prompt_end` they start right after the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import BlockDiffusionConfig


@dataclass
class BlockGeometry:
    prompt_len: torch.Tensor  # [R] long
    first_block_start: torch.Tensor  # [R] long: end of the prefill, start of decode block 0
    row_end: torch.Tensor  # [R] long: canvas length (the last block may end past prompt + max_new_tokens)
    num_blocks: torch.Tensor  # [R] long
    positions: torch.Tensor  # [R, NB, B] long: canvas position of each block slot
    valid: torch.Tensor  # [R, NB, B] bool: slot lies inside the canvas
    block_size: int

    @classmethod
    def build(cls, prompt_len: torch.Tensor, cfg: BlockDiffusionConfig) -> "BlockGeometry":
        size, new = cfg.block_size, cfg.max_new_tokens
        if cfg.alignment == "absolute":
            first = prompt_len // size * size
            num_blocks = (prompt_len + new - first + size - 1) // size
            row_end = first + num_blocks * size
        else:
            first = prompt_len
            num_blocks = torch.full_like(prompt_len, (new + size - 1) // size)
            row_end = prompt_len + new
        max_blocks = int(num_blocks.max())
        offsets = torch.arange(max_blocks * size, device=prompt_len.device).view(1, max_blocks, size)
        positions = first.view(-1, 1, 1) + offsets
        return cls(prompt_len, first, row_end, num_blocks, positions, positions < row_end.view(-1, 1, 1), size)

    def block_end(self, rows: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """Exclusive canvas end of decode block `block` ([len(rows)] or [len(rows), X]) of each of `rows`."""
        shape = (-1,) + (1,) * (block.dim() - 1)
        first = self.first_block_start[rows].view(shape)
        return torch.minimum(first + (block + 1) * self.block_size, self.row_end[rows].view(shape))


@dataclass
class BlockStatus:
    """Block bookkeeping derived from the canvas at one moment ([R, NB] tensors)."""

    masked: torch.Tensor  # [R, NB, B] bool
    remaining: torch.Tensor  # masked positions per block
    progress: torch.Tensor  # decided fraction per block (1 for blocks past the row's last)
    complete: torch.Tensor


class DecodeState:
    """The canvas plus block counters of every row; all updates are tensor ops."""

    def __init__(self, prompts: list[torch.Tensor], cfg: BlockDiffusionConfig, device: torch.device):
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        self.cfg = cfg
        self.geometry = geo = BlockGeometry.build(lengths, cfg)
        rows, width = len(prompts), int(geo.row_end.max())
        self.canvas = torch.full((rows, width), cfg.mask_token_id, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            self.canvas[row, : len(prompt)] = prompt.to(device)
        max_blocks = geo.positions.shape[1]
        self.added = torch.zeros(rows, dtype=torch.long, device=device)
        self.stored = torch.zeros(rows, dtype=torch.long, device=device)
        self.full = torch.zeros(rows, max_blocks, dtype=torch.bool, device=device)
        self.forced_steps = torch.zeros(rows, max_blocks, dtype=torch.long, device=device)
        self.draws = torch.zeros(rows, dtype=torch.long, device=device)
        self.done = torch.zeros(rows, dtype=torch.bool, device=device)
        self.previous = torch.full((rows, width), -1, dtype=torch.long, device=device)
        self.commit_step = torch.full((rows, width), -1, dtype=torch.long, device=device)
        self.logprob = torch.zeros(rows, width, dtype=torch.float32, device=device)
        self.entropy = torch.zeros(rows, width, dtype=torch.float32, device=device)
        self.block_index = torch.arange(max_blocks, device=device)

    @property
    def num_rows(self) -> int:
        return self.canvas.shape[0]

    def status(self) -> BlockStatus:
        geo = self.geometry
        rows, blocks, size = geo.positions.shape
        tokens = self.canvas.gather(1, geo.positions.clamp(max=self.canvas.shape[1] - 1).view(rows, -1))
        masked = geo.valid & (tokens.view(rows, blocks, size) == self.cfg.mask_token_id)
        remaining = masked.sum(-1)
        length = geo.valid.sum(-1)
        progress = torch.where(length > 0, 1.0 - remaining / length.clamp(min=1), 1.0)
        return BlockStatus(masked, remaining, progress, remaining == 0)

    def activate(self, status: BlockStatus) -> None:
        """Add at most one block per row (DESIGN §3.4) and mark blocks fully activated."""
        cfg, blocks = self.cfg, self.block_index
        is_added = blocks < self.added[:, None]
        last = (self.added - 1).clamp(min=0)[:, None]
        last_progress = torch.where(self.added > 0, status.progress.gather(1, last).squeeze(1), 1.0)
        last_complete = torch.where(self.added > 0, status.complete.gather(1, last).squeeze(1), True)
        active = (is_added & ~status.complete).sum(-1)
        can_add = (
            ~self.done
            & (self.added < self.geometry.num_blocks)
            & ((last_progress >= cfg.block_add_threshold) | last_complete)
            & (active < cfg.max_active_blocks)
        )
        predecessor = torch.cat([torch.ones_like(status.progress[:, :1]), status.progress[:, :-1]], dim=1)
        self.full |= is_added & (predecessor >= cfg.decoded_token_threshold)
        self.added += can_add.long()
        new = can_add[:, None] & (blocks == (self.added - 1)[:, None])
        on_add = cfg.decoded_token_threshold if cfg.add_activation_threshold is None else cfg.add_activation_threshold
        self.full |= new & (predecessor >= on_add)

    def commit(self, rows: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, logprob: torch.Tensor,
               entropy: torch.Tensor, forward_index: int) -> None:
        """Write decided tokens and what RL users need about them."""
        self.canvas[rows, positions] = tokens
        self.commit_step[rows, positions] = forward_index
        self.logprob[rows, positions] = logprob
        self.entropy[rows, positions] = entropy

    def fill_after_stop(self, stop_ids: torch.Tensor, forward_index: int) -> None:
        """d3LLM's EOS fill: every position after a row's first decided stop token becomes that token."""
        first, has_stop = self.first_stop(stop_ids)
        positions = torch.arange(self.canvas.shape[1], device=self.canvas.device)
        after = has_stop[:, None] & (positions > first[:, None]) & (positions < self.geometry.row_end[:, None])
        token = self.canvas.gather(1, first[:, None]).expand_as(self.canvas)
        newly = after & (self.canvas == self.cfg.mask_token_id)
        self.commit_step[newly] = forward_index
        self.canvas = torch.where(after, token, self.canvas)

    def leading_complete(self, status: BlockStatus) -> torch.Tensor:
        """Number of complete added blocks right after the stored ones: what the next forward can store."""
        is_added = self.block_index < self.added[:, None]
        return (status.complete & is_added).long().cumprod(-1).sum(-1) - self.stored

    def stopped(self, status: BlockStatus, stop_ids: torch.Tensor) -> torch.Tensor:
        """Rows whose first stop token lies in a complete block after which nothing earlier is undecided."""
        if stop_ids.numel() == 0:
            return torch.zeros_like(self.done)
        first, has_stop = self.first_stop(stop_ids)
        geo = self.geometry
        stop_block = (first - geo.first_block_start).div(geo.block_size, rounding_mode="floor")
        upto = self.block_index[None] <= stop_block[:, None]
        settled = (status.complete | ~upto).all(-1)
        if not self.cfg.fused_store and self.cfg.attention == "block_causal":
            settled &= self.stored > stop_block
        return has_stop & settled

    def first_stop(self, stop_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Canvas position of each row's first stop token in its generated part, and whether there is one."""
        geo = self.geometry
        positions = torch.arange(self.canvas.shape[1], device=self.canvas.device)
        generated = (positions >= geo.prompt_len[:, None]) & (
            positions < (geo.prompt_len + self.cfg.max_new_tokens)[:, None]
        )
        hits = generated & torch.isin(self.canvas, stop_ids)
        return hits.int().argmax(-1), hits.any(-1)

    def schedule(self, rows: torch.Tensor, blocks: torch.Tensor, remaining: torch.Tensor) -> torch.Tensor:
        """n_t = ⌊L/S⌋ + [t < L mod S] for block length L at its t-th forced step; all that remains once t ≥ S."""
        steps = self.cfg.steps_per_block
        length = self.geometry.valid[rows, blocks].sum(-1)
        t = self.forced_steps[rows, blocks]
        n = length // steps + (t < length % steps).long()
        return torch.where(t >= steps, remaining, n)
