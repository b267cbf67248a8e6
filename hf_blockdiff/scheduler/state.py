"""Decode state: every slot's canvas and block bookkeeping (docs/architecture.md, "The decode loop"), as fixed-size tensors.

A slot holds one prompt at a time (prompt streaming refills finished slots). Slots are kept in their own coordinates
(position 0 = the prompt's first token, whatever the caller's left padding), so a prompt decodes the same alone or in
any batch. Decode block j of a slot covers `[first_block_start + j·B, … + B)` clipped to `row_end`: for `absolute`
alignment blocks sit at multiples of B and the first one holds the prompt tail; for `prompt_end` they start right
after the prompt. Every update is a tensor op on fixed shapes, so a step can run inside a CUDA graph. Column
`width` of the canvas is a scratch column that absorbs writes of padding slots.

Only the methods of `DecodeState` write its tensors, and only the scheduler calls them: a step's choices reach the
state as one `Decision` (`apply`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import BlockDiffusionConfig
from .settings import SlotSettings, slot_values


def geometry(prompt_len: torch.Tensor, cfg: BlockDiffusionConfig, new: torch.Tensor | None = None):
    """(first_block_start, row_end, num_blocks) of prompts of these lengths generating `new` tokens each (None: the
    config's max_new_tokens)."""
    size = cfg.block_size
    new = torch.full_like(prompt_len, cfg.max_new_tokens) if new is None else new
    if cfg.alignment == "absolute":
        first = prompt_len // size * size
        num_blocks = (prompt_len + new - first + size - 1) // size
        return first, first + num_blocks * size, num_blocks
    return prompt_len, prompt_len + new, (new + size - 1) // size


@dataclass
class BlockStatus:
    """Block bookkeeping derived from the canvas at one moment ([R, NB] tensors)."""

    masked: torch.Tensor  # [R, NB, B] bool
    remaining: torch.Tensor  # masked positions per block
    progress: torch.Tensor  # decided fraction per block (1 for blocks past the slot's last)
    complete: torch.Tensor  # no mask left and not refining (editing)


@dataclass
class Decision:
    """What one step decided. `commit` marks the positions (of `rows`, at `positions`) that take `tokens`, with the
    log-probability and entropy they were drawn with; the other fields are the strategy's bookkeeping: last proposals
    at (proposal_rows, proposal_positions), forced steps per active block (forced_rows, forced_blocks, forced), and
    the slots that took a decoding step (`stepped`). With editing, `edit` marks decided positions that take `tokens`
too, `remask` decided positions that turn back into masks, and per active block `post` says the step was a
refinement step (no mask at its start) and `refining` whether the block keeps refining after it."""

    rows: torch.Tensor
    positions: torch.Tensor
    tokens: torch.Tensor
    logprob: torch.Tensor
    entropy: torch.Tensor
    commit: torch.Tensor
    proposal_rows: torch.Tensor | None = None
    proposal_positions: torch.Tensor | None = None
    proposals: torch.Tensor | None = None
    forced_rows: torch.Tensor | None = None
    forced_blocks: torch.Tensor | None = None
    forced: torch.Tensor | None = None
    stepped: torch.Tensor | None = None
    edit: torch.Tensor | None = None
    remask: torch.Tensor | None = None
    post: torch.Tensor | None = None
    refining: torch.Tensor | None = None


class DecodeState:
    def __init__(self, rows: int, width: int, max_blocks: int, cfg: BlockDiffusionConfig, device: torch.device):
        self.cfg, self.block_size = cfg, cfg.block_size

        def zeros(*shape, dtype=torch.long, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.prompt_len, self.first_block_start, self.row_end, self.num_blocks = (zeros(rows) for _ in range(4))
        self.canvas = zeros(rows, width + 1, fill=cfg.mask_token_id)
        self.previous = zeros(rows, width + 1, fill=-1)
        self.commit_step = zeros(rows, width + 1, fill=-1)
        self.logprob = zeros(rows, width + 1, dtype=torch.float32)
        self.entropy = zeros(rows, width + 1, dtype=torch.float32)
        self.added, self.stored, self.draws = zeros(rows), zeros(rows), zeros(rows)  # draws: decoding steps
        self.seed = zeros(rows)  # each slot's sampling seed: its noise depends on nothing else
        # each slot's own settings (scheduler/settings.py): its length, sampling and strategy threshold
        self.max_new, self.top_k = zeros(rows), zeros(rows)
        self.inverse_temperature, self.top_p_drop, self.threshold, self.log_threshold = (
            zeros(rows, dtype=torch.float32) for _ in range(4))
        self.full = zeros(rows, max_blocks, dtype=torch.bool)
        self.forced_steps = zeros(rows, max_blocks)
        self.refining = zeros(rows, max_blocks, dtype=torch.bool)  # editing: filled blocks that keep refining
        self.post_steps = zeros(rows, max_blocks)  # editing: refinement steps of each block after it was filled
        self.edits = zeros(rows)  # editing: decided tokens replaced
        self.done = zeros(rows, dtype=torch.bool, fill=True)
        self.nonfinite = zeros(rows, fill=-1)  # the forward whose scores first came out inf/nan, per slot (-1: none)
        self.forward_index = zeros(1)  # forwards so far, on the device so a captured step can count itself
        self.block_index = torch.arange(max_blocks, device=device)
        self.offsets = torch.arange(max_blocks * cfg.block_size, device=device).view(max_blocks, cfg.block_size)

    @property
    def num_rows(self) -> int:
        return self.canvas.shape[0]

    @property
    def width(self) -> int:
        """Canvas positions per slot (a size of the canvas: compiled bookkeeping traces it as a dimension)."""
        return self.canvas.shape[1] - 1

    def fits(self, rows: int, width: int, max_blocks: int) -> bool:
        return rows == self.num_rows and width <= self.width and max_blocks <= len(self.block_index)

    def load(self, slots: torch.Tensor, prompts: list[torch.Tensor], seeds: torch.Tensor,
             settings: list[SlotSettings]) -> None:
        """Put `prompts` into `slots`: fresh canvases and counters, the prompts' sampling seeds and settings."""
        for name, values in slot_values(settings, slots.device).items():
            getattr(self, name)[slots] = values
        lengths = torch.tensor([len(p) for p in prompts], device=slots.device)
        first, row_end, num_blocks = geometry(lengths, self.cfg, self.max_new[slots])
        self.prompt_len[slots], self.first_block_start[slots] = lengths, first
        self.row_end[slots], self.num_blocks[slots] = row_end, num_blocks
        positions = torch.arange(self.width + 1, device=slots.device)
        canvas = torch.where(positions < row_end[:, None], self.cfg.mask_token_id, self.cfg.pad_token_id)
        for row, prompt in enumerate(prompts):
            canvas[row, : len(prompt)] = prompt.to(slots.device)
        self.canvas[slots] = canvas
        self.seed[slots] = seeds.to(self.seed.device)
        for buffer, fill in ((self.previous, -1), (self.commit_step, -1), (self.logprob, 0), (self.entropy, 0),
                             (self.added, 0), (self.stored, 0), (self.draws, 0), (self.full, False),
                             (self.forced_steps, 0), (self.refining, False), (self.post_steps, 0), (self.edits, 0),
                             (self.done, False), (self.nonfinite, -1)):
            buffer[slots] = fill

    # -- geometry --------------------------------------------------------------------------------------------------

    @property
    def positions(self) -> torch.Tensor:
        """[R, NB, B] canvas position of each block slot."""
        return self.first_block_start[:, None, None] + self.offsets

    @property
    def slot_valid(self) -> torch.Tensor:
        """[R, NB, B]: the block slot lies inside the canvas."""
        return self.positions < self.row_end[:, None, None]

    def block_end(self, rows: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """Exclusive canvas end of decode block `block` of slots `rows` (`rows` matches `block`'s leading dims)."""
        first, end = self.first_block_start[rows], self.row_end[rows]
        while first.dim() < block.dim():
            first, end = first.unsqueeze(-1), end.unsqueeze(-1)
        return torch.minimum(first + (block + 1) * self.block_size, end)

    def key_limit(self, rows: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Block-causal rule: the end of the block holding `position` ([len(rows), X]). The prefix before the
        first decode block is a staircase of blocks from position 0 (prompt_attention block_causal, absolute blocks)
        or one block."""
        size = self.block_size
        first = self.first_block_start[rows][:, None]
        in_prefix = position < first
        if self.cfg.prompt_attention == "block_causal":
            prefix_end = (position // size + 1) * size
        else:
            prefix_end = first.expand_as(position)
        decode_end = self.block_end(rows, (position - first).clamp(min=0) // size)
        return torch.where(in_prefix, prefix_end, decode_end)

    # -- block state ---------------------------------------------------------------------------------------------------

    def status(self) -> BlockStatus:
        rows, blocks, size = self.full.shape[0], self.full.shape[1], self.block_size
        valid = self.slot_valid
        tokens = self.canvas.gather(1, self.positions.clamp(max=self.width).view(rows, -1)).view(rows, blocks, size)
        masked = valid & (tokens == self.cfg.mask_token_id)
        remaining = masked.sum(-1)
        length = valid.sum(-1)
        progress = torch.where(length > 0, 1.0 - remaining / length.clamp(min=1), 1.0)
        return BlockStatus(masked, remaining, progress, (remaining == 0) & ~self.refining)

    def activate(self, status: BlockStatus, slots: torch.Tensor) -> None:
        """Mark blocks of `slots` ([R] bool) fully activated and add at most one block per slot (docs/architecture.md,
        "The decode loop": multi-block rules)."""
        cfg, blocks = self.cfg, self.block_index
        is_added = blocks < self.added[:, None]
        last = (self.added - 1).clamp(min=0)[:, None]
        last_progress = torch.where(self.added > 0, status.progress.gather(1, last).squeeze(1), 1.0)
        last_complete = torch.where(self.added > 0, status.complete.gather(1, last).squeeze(1), True)
        active = (is_added & ~status.complete).sum(-1)
        can_add = (
            slots
            & ~self.done
            & (self.added < self.num_blocks)
            & ((last_progress >= cfg.block_add_threshold) | last_complete)
            & (active < cfg.max_active_blocks)
        )
        predecessor = torch.cat([torch.ones_like(status.progress[:, :1]), status.progress[:, :-1]], dim=1)
        self.full |= slots[:, None] & is_added & (predecessor >= cfg.decoded_token_threshold)
        self.added += can_add.long()
        new = can_add[:, None] & (blocks == (self.added - 1)[:, None])
        on_add = cfg.decoded_token_threshold if cfg.add_activation_threshold is None else cfg.add_activation_threshold
        self.full |= new & (predecessor >= on_add)

    def leading_complete(self, status: BlockStatus) -> torch.Tensor:
        """Number of complete added blocks right after the stored ones: what the next forward can store."""
        is_added = self.block_index < self.added[:, None]
        return (status.complete & is_added).long().cumprod(-1).sum(-1) - self.stored

    def schedule(self, rows: torch.Tensor, blocks: torch.Tensor, remaining: torch.Tensor) -> torch.Tensor:
        """n_t = ⌊L/S⌋ + [t < L mod S] for block length L at its t-th forced step; all that remains once t ≥ S."""
        steps = self.cfg.steps_per_block
        length = self.block_end(rows, blocks) - self.first_block_start[rows] - blocks * self.block_size
        t = self.forced_steps[rows, blocks]
        n = length // steps + (t < length % steps).long()
        return torch.where(t >= steps, remaining, n)

    # -- writing and stopping ----------------------------------------------------------------------------------------

    def start_call(self) -> None:
        """A new call: forwards count from zero (`commit_step` is within the call), every slot idle."""
        self.forward_index.zero_()
        self.done.fill_(True)
        self.nonfinite.fill_(-1)

    def count_forward(self, ran: torch.Tensor | bool) -> None:
        self.forward_index += ran

    def mark_stored(self, blocks: torch.Tensor) -> None:
        """`blocks` [R] more blocks of each slot are in the cache."""
        self.stored += blocks

    def finish(self, finished: torch.Tensor) -> None:
        self.done |= finished

    def mark_nonfinite(self, rows: torch.Tensor) -> None:
        """Slots `rows` ([R] bool) got non-finite scores in this forward (the first such forward is kept)."""
        self.nonfinite.copy_(torch.where(rows & (self.nonfinite < 0), self.forward_index, self.nonfinite))

    def apply(self, decision: Decision) -> None:
        """Write one step's decision: the committed tokens and the strategy's bookkeeping."""
        if decision.proposals is not None:
            self.previous[decision.proposal_rows, decision.proposal_positions] = decision.proposals
        if decision.forced is not None:
            self.forced_steps.index_put_((decision.forced_rows, decision.forced_blocks), decision.forced.long(),
                                         accumulate=True)
        written = decision.commit
        if decision.edit is not None:
            written = written | decision.edit
            self._refine(decision)
        self.commit(decision.rows, decision.positions, decision.tokens, decision.logprob, decision.entropy, written)
        if decision.stepped is not None:
            self.draws += decision.stepped.long()

    def _refine(self, decision: Decision) -> None:
        """Editing bookkeeping of the active blocks (one per slot, so no two writes meet): edits per slot, remasked
        positions undecided again, refinement steps and whether each block keeps refining."""
        rows, blocks, valid = decision.forced_rows, decision.forced_blocks, decision.stepped[:, None]
        self.edits += decision.edit.sum((1, 2))
        positions = torch.where(decision.remask, decision.positions, self.width)
        # device-side values: a Python scalar would be copied from the host, which a CUDA graph cannot capture
        self.canvas[decision.rows, positions] = torch.full_like(positions, self.cfg.mask_token_id)
        self.commit_step[decision.rows, positions] = torch.full_like(positions, -1)
        self.post_steps.index_put_((rows, blocks), (decision.post & valid).long(), accumulate=True)
        self.refining[rows, blocks] = torch.where(valid, decision.refining, self.refining[rows, blocks])

    def commit(self, rows: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor, logprob: torch.Tensor,
               entropy: torch.Tensor, chosen: torch.Tensor) -> None:
        """Write the `chosen` tokens (others go to the scratch column) and what RL users need about them."""
        positions = torch.where(chosen, positions, self.width)
        self.canvas[rows, positions] = tokens
        self.commit_step[rows, positions] = self.forward_index.expand_as(positions)
        self.logprob[rows, positions] = logprob
        self.entropy[rows, positions] = entropy

    def decided_canvas(self) -> torch.Tensor:
        """[R, width + 1] the canvases with the mask id past each slot's end and in the scratch column: what a slot
        has (prompt and decided tokens) and nothing of the batch it shares shapes with."""
        positions = torch.arange(self.width + 1, device=self.canvas.device)
        return torch.where(positions < self.row_end[:, None], self.canvas, self.cfg.mask_token_id)

    def generated(self) -> torch.Tensor:
        """[R, width + 1] bool: inside the slot's generated positions (its own `max_new_tokens`)."""
        positions = torch.arange(self.width + 1, device=self.canvas.device)
        return (positions >= self.prompt_len[:, None]) & (positions < (self.prompt_len + self.max_new)[:, None])

    def repeat_end(self, run: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Canvas position where each slot's first run of `run` equal tokens ends, among its generated tokens decided
        from the first on, and whether there is one (docs/architecture.md, "The decode loop": request limits)."""
        if run > self.width + 1:
            return self.prompt_len, torch.zeros_like(self.done)
        generated = self.generated()
        undecided = generated & (self.canvas == self.cfg.mask_token_id)
        settled = generated & (undecided.long().cumsum(-1) == 0)
        windows = self.canvas.unfold(-1, run, 1)
        hits = (windows == windows[..., :1]).all(-1) & settled.unfold(-1, run, 1).all(-1)
        return hits.long().argmax(-1) + run - 1, hits.any(-1)

    def stop_hits(self, stop_ids: torch.Tensor) -> torch.Tensor:
        """[R, width + 1] bool: stop tokens in the slots' generated parts."""
        return self.generated() & torch.isin(self.canvas, stop_ids)

    def first_stop(self, stop_ids: torch.Tensor, hits: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Canvas position of each slot's first stop token in its generated part, and whether there is one (`hits`:
        `stop_hits(stop_ids)` when the caller has them)."""
        hits = self.stop_hits(stop_ids) if hits is None else hits
        return hits.int().argmax(-1), hits.any(-1)

    def wrote_stop(self, hits: torch.Tensor) -> torch.Tensor:
        """[R]: the slot's last step wrote one of the stop tokens `hits` marks (committed or edited)."""
        return (hits & (self.commit_step == self.forward_index)).any(-1)

    def decided_before(self, position: torch.Tensor) -> torch.Tensor:
        """[R]: no generated position of the slot before `position` [R] is undecided."""
        positions = torch.arange(self.width + 1, device=self.canvas.device)
        before = self.generated() & (positions < position[:, None])
        return ~(before & (self.canvas == self.cfg.mask_token_id)).any(-1)

    def stop_block(self, stop_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode block of each slot's first stop token, and whether there is one."""
        first, has_stop = self.first_stop(stop_ids)
        return (first - self.first_block_start).div(self.block_size, rounding_mode="floor"), has_stop

    def settled_through(self, status: BlockStatus, block: torch.Tensor) -> torch.Tensor:
        """[R]: every block of the slot up to `block` is complete."""
        upto = self.block_index[None] <= block[:, None]
        return (status.complete | ~upto).all(-1)

    def fill_after_stop(self, stop_ids: torch.Tensor) -> None:
        """d3LLM's EOS fill: every position after a slot's first decided stop token becomes that token."""
        first, has_stop = self.first_stop(stop_ids)
        positions = torch.arange(self.width + 1, device=self.canvas.device)
        after = has_stop[:, None] & (positions > first[:, None]) & (positions < self.row_end[:, None])
        newly = after & (self.canvas == self.cfg.mask_token_id)
        self.commit_step.masked_fill_(newly, 0)
        self.commit_step += newly.long() * self.forward_index
        self.canvas.copy_(torch.where(after, self.canvas.gather(1, first[:, None]), self.canvas))
