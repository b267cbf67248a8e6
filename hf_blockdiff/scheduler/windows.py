"""Window policies: one class per decoding mode (docs/architecture.md, "The decode loop" and "Architecture").

A policy answers, for every slot and from the decode state alone: which span of canvas positions the next forward
runs (`spans`), which keys each query may see (`key_limits`), which finished blocks that forward stores
(`store_count`) and what it committed to the cache afterwards (`stored`), which undecided positions the strategy may
commit (`candidates`), when a slot is finished or stopped, and the most chunks one slot's window can need (the chunk
bound that lets small CUDA-graph steps chain). Everything is tensor ops on fixed shapes; no policy knows the model.

    FullRecompute   bidirectional models, the whole canvas every step (LLaDA, Dream)
    PrefixCache     Fast-dLLM v1: the whole canvas at each block start, then the block and everything after it
    DualCache       Fast-dLLM v1: the whole canvas at each block start, then the block alone
    BlockCausal     exact cache, one block; a finished block is stored in the next block's first forward
    MultiBlock      exact cache, several active blocks (d3LLM): windows have no bound
    StoreForward    exact cache, a forward of its own stores each finished block (SDAR's reference count)
    SubBlocks       Fast-dLLM v2: store forwards, sub-block by sub-block, the storing forward decides the next
                    block's first token (`store_decision`)
    Editing         LLaDA2.1 and Diffulex's edit/DMax: BlockCausal whose active block's decided tokens may be
                    edited or remasked, and which keeps refining after its last mask is filled

A new mode is a `WindowPolicy` subclass here (its docstring lists what a mode defines), chosen in `window_policy`,
and a test against a plain reference loop.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..config import BlockDiffusionConfig
from ..strategies import BlockScores, StrategyParams, select_edits, select_remasks
from .chunks import Chunks
from .state import BlockStatus, DecodeState


@dataclass
class Stored:
    """What a forward committed to the cache: slots `has` now hold `length` final positions, `blocks` more decode
    blocks than before (0 where an approximate cache stored a prefix)."""

    has: torch.Tensor  # [R] bool
    length: torch.Tensor  # [R]
    blocks: torch.Tensor  # [R]


@dataclass
class StoreDecision:
    """Positions a storing forward decides: `position` of each slot in `rows`, where `open` (undecided)."""

    rows: torch.Tensor  # [R]
    position: torch.Tensor  # [R]
    open: torch.Tensor  # [R] bool


class WindowPolicy(ABC):
    """The base of a decoding mode. A new mode defines which span of the canvas each forward runs (`spans`), which
    keys each query sees (`key_limits`), which finished blocks a forward stores (`store_count`) and what it committed
    (`stored`); it may narrow which positions a step commits (`candidates`, `decoding`), let it edit decided ones
    (`editable`), say when a slot is finished or stopped (`finished`, `stopped`, `settled`), bound its window for
    CUDA graphs (`chunk_bound`), and decide positions from the logits of a storing forward (`store_decision`)."""

    prefills = False  # whether what precedes the first decode block is cached by a prefill

    def __init__(self, cfg: BlockDiffusionConfig):
        self.cfg = cfg

    @abstractmethod
    def key_limits(self, state: DecodeState, chunks: Chunks) -> torch.Tensor:
        """Per-query key limits of the chunks (0 for padding)."""

    @abstractmethod
    def store_count(self, state: DecodeState, status: BlockStatus) -> torch.Tensor:
        """[R] finished blocks the next forward stores."""

    @abstractmethod
    def spans(self, state: DecodeState, status: BlockStatus, active: torch.Tensor, store: torch.Tensor):
        """Each slot's window [start, end); empty for slots with nothing to do."""

    @abstractmethod
    def stored(self, state: DecodeState, chunks: Chunks, store: torch.Tensor) -> Stored | None:
        """What the forward over `chunks` committed to the cache (None: nothing)."""

    def decoding(self, active: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
        """The active blocks ([R, NB] bool) the next forward decides."""
        return active

    def candidates(self, candidates: torch.Tensor) -> torch.Tensor:
        """Undecided positions ([R, K, B]) of the active blocks that the strategy may commit this step."""
        return candidates

    def editable(self, state: DecodeState, status: BlockStatus, rows: torch.Tensor, blocks: torch.Tensor,
                 valid: torch.Tensor) -> torch.Tensor | None:
        """Decided positions ([R, K, B]) of the active blocks (`blocks` [R, K] of `rows` [R, 1]) an edit may
        replace; None: the mode never edits."""
        return None

    def finished(self, state: DecodeState, status: BlockStatus) -> torch.Tensor:
        """[R]: every block was added and is complete."""
        return (state.added == state.num_blocks) & status.complete.all(-1)

    def stopped(self, state: DecodeState, status: BlockStatus, stop_ids: torch.Tensor) -> torch.Tensor:
        """[R]: the block of the slot's first stop token is settled (see `settled`)."""
        block, has_stop = state.stop_block(stop_ids)
        return has_stop & self.settled(state, status, block)

    def settled(self, state: DecodeState, status: BlockStatus, block: torch.Tensor) -> torch.Tensor:
        """[R]: blocks up to `block` are complete (nothing before the stop token is undecided)."""
        return state.settled_through(status, block)

    def chunk_bound(self, block_size: int, chunk: int) -> int | None:
        """The most chunks one slot's window needs in any step, where the mode bounds it."""
        return None

    def store_decision(self, state: DecodeState, stored: Stored) -> StoreDecision | None:
        """Positions the forward that stored blocks decides greedily from the stored prefix's last hidden state
        (None: the mode decides nothing there)."""
        return None


class FullRecompute(WindowPolicy):
    """Bidirectional models: the whole canvas every step, nothing cached."""

    def key_limits(self, state: DecodeState, chunks: Chunks) -> torch.Tensor:
        """The whole canvas."""
        limit = state.row_end[chunks.rows][:, None].expand_as(chunks.positions)
        return torch.where(chunks.valid, limit, 0)

    def store_count(self, state: DecodeState, status: BlockStatus) -> torch.Tensor:
        return torch.zeros_like(state.added)

    def spans(self, state: DecodeState, status: BlockStatus, active: torch.Tensor, store: torch.Tensor):
        rows = torch.arange(state.num_rows, device=active.device)
        start, end = self.span(state, rows)
        work = active.any(-1) & ~state.done
        return start, torch.where(work, end, start)

    def span(self, state: DecodeState, rows: torch.Tensor):
        return torch.zeros_like(rows), state.row_end

    def stored(self, state: DecodeState, chunks: Chunks, store: torch.Tensor) -> Stored | None:
        return None


class PrefixCache(FullRecompute):
    def span(self, state: DecodeState, rows: torch.Tensor):
        block = (state.added - 1).clamp(min=0)
        fresh = state.forced_steps[rows, block] == 0
        start = torch.where(fresh, 0, state.first_block_start + block * state.block_size)
        return start, self.span_end(state, rows, block, fresh)

    def span_end(self, state: DecodeState, rows: torch.Tensor, block: torch.Tensor, fresh: torch.Tensor):
        return state.row_end

    def stored(self, state: DecodeState, chunks: Chunks, store: torch.Tensor) -> Stored:
        """A block-start forward ran the whole canvas: its prefix is as final as it gets."""
        block_start = state.first_block_start + (state.added - 1).clamp(min=0) * state.block_size
        return Stored((chunks.start == 0) & (chunks.end > chunks.start), block_start, torch.zeros_like(block_start))


class DualCache(PrefixCache):
    def span_end(self, state: DecodeState, rows: torch.Tensor, block: torch.Tensor, fresh: torch.Tensor):
        return torch.where(fresh, state.row_end, state.block_end(rows, block))


class BlockCausal(WindowPolicy):
    prefills = True

    def key_limits(self, state: DecodeState, chunks: Chunks) -> torch.Tensor:
        """The end of each query's block."""
        return torch.where(chunks.valid, state.key_limit(chunks.rows, chunks.positions), 0)

    def store_count(self, state: DecodeState, status: BlockStatus) -> torch.Tensor:
        return state.leading_complete(status)

    def spans(self, state: DecodeState, status: BlockStatus, active: torch.Tensor, store: torch.Tensor):
        """From the first block not in the cache to the last one added (or the last one to store)."""
        rows = torch.arange(state.num_rows, device=active.device)
        first = state.stored
        start = state.first_block_start + first * state.block_size
        end = state.block_end(rows, (self.last_block(state, store) - 1).clamp(min=0))
        work = self.works(active, store) & ~state.done
        return start, torch.where(work, end, start)

    def last_block(self, state: DecodeState, store: torch.Tensor) -> torch.Tensor:
        return state.added

    def works(self, active: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
        return active.any(-1)

    def stored(self, state: DecodeState, chunks: Chunks, store: torch.Tensor) -> Stored:
        """The finished blocks at the window's front were computed from final tokens."""
        rows = torch.arange(state.num_rows, device=store.device)
        has = (store > 0) & (chunks.end > chunks.start)
        length = state.block_end(rows, (state.stored + store - 1).clamp(min=0))
        return Stored(has, length, torch.where(has, store, 0))

    def chunk_bound(self, block_size: int, chunk: int) -> int | None:
        """The block and, stored in the same forward, the finished block before it."""
        return 2 * -(-block_size // chunk)


class MultiBlock(BlockCausal):
    def chunk_bound(self, block_size: int, chunk: int) -> int | None:
        """None: complete blocks wait in the window until every block before them is complete."""
        return None


class StoreForward(BlockCausal):
    def decoding(self, active: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
        """A storing forward decides nothing."""
        return active & (store == 0)[:, None]

    def last_block(self, state: DecodeState, store: torch.Tensor) -> torch.Tensor:
        return torch.where(store > 0, state.stored + store, state.added)

    def works(self, active: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
        return active.any(-1) | (store > 0)

    def finished(self, state: DecodeState, status: BlockStatus) -> torch.Tensor:
        return super().finished(state, status) & (state.stored == state.num_blocks)

    def settled(self, state: DecodeState, status: BlockStatus, block: torch.Tensor) -> torch.Tensor:
        """The stop token's block must be stored as well (the reference stores it before it stops)."""
        return super().settled(state, status, block) & (state.stored > block)

    def chunk_bound(self, block_size: int, chunk: int) -> int | None:
        """The block alone: a finished block is stored in a forward of its own."""
        return -(-block_size // chunk)


class SubBlocks(StoreForward):
    def __init__(self, cfg: BlockDiffusionConfig):
        super().__init__(cfg)
        self.sub_block_size = cfg.sub_block_size or cfg.block_size

    def candidates(self, candidates: torch.Tensor) -> torch.Tensor:
        """Only the first sub-block that still has masks."""
        sub, shape = self.sub_block_size, candidates.shape
        has_mask = candidates.view(*shape[:2], shape[2] // sub, sub).any(-1)
        first = has_mask.int().argmax(-1, keepdim=True)
        return candidates & (torch.arange(shape[2], device=candidates.device) // sub == first)


    def store_decision(self, state: DecodeState, stored: Stored) -> StoreDecision | None:
        """With `first_token_on_store` (Fast-dLLM v2) the storing forward decides the first position after each
        slot's stored prefix, where it is still undecided."""
        if not self.cfg.first_token_on_store:
            return None
        rows = torch.arange(state.num_rows, device=stored.has.device)
        position = stored.length.clamp(max=state.width)
        open_ = stored.has & (position < state.row_end) & (state.canvas[rows, position] == self.cfg.mask_token_id)
        return StoreDecision(rows, position, open_)


class Editing(BlockCausal):
    """Editable decoding (docs/architecture.md, "The decode loop"): LLaDA2.1 as diffusers' BlockRefinementScheduler
    and LLaDA2Pipeline define it, and Diffulex's edit/DMax rules as parameters (remasking, stability, the step cap;
    their defaults give LLaDA2.1). Every step the active block's decided generated positions may be edited or
    remasked; a block filled before its S-th step keeps refining (it is not complete, so it is neither stored nor
    followed) while its refinement steps change more than the stability threshold allows, for at most
    `max_post_steps` + 1 such steps; a block's (S + max_post_steps)-th step commits every mask left, remasks nothing
    and ends it; a slot stops after a step that wrote a stop token when nothing before its first stop token is
    undecided."""

    def editable(self, state: DecodeState, status: BlockStatus, rows: torch.Tensor, blocks: torch.Tensor,
                 valid: torch.Tensor) -> torch.Tensor:
        generated = state.positions[rows, blocks] >= state.prompt_len[rows][..., None]
        return valid[..., None] & state.slot_valid[rows, blocks] & generated & ~status.masked[rows, blocks]

    def edit_decision(self, state: DecodeState, status: BlockStatus, active, scores: BlockScores,
                      params: StrategyParams, transfer: torch.Tensor, forced: torch.Tensor) -> dict:
        """The Decision's commit and editing fields for the active blocks (`active`: the scheduler's ActiveBlocks)
        given the strategy's `transfer` and `forced` blocks: at a block's last allowed step every mask is committed
        and nothing remasked."""
        rows, blocks = active.rows, active.blocks
        steps = state.forced_steps[rows, blocks] + forced.long()  # the active block is forced at each of its steps
        final = steps >= self.cfg.steps_per_block + self.cfg.max_post_steps
        scores.final = final.view(-1)
        commit = transfer | (active.candidates & final[..., None])
        remask = select_remasks(scores, params).view(transfer.shape)
        edit = select_edits(scores, params).view(transfer.shape)
        remaining = status.remaining[rows, blocks]
        post = remaining == 0
        filled = (remaining == commit.sum(-1)) & ~remask.any(-1)
        refining = filled & ~final & self.keeps_refining(state, rows, blocks, post, steps, active.editable,
                                                         edit | remask)
        return dict(commit=commit, edit=edit, remask=remask, post=post, refining=refining)

    def keeps_refining(self, state: DecodeState, rows: torch.Tensor, blocks: torch.Tensor, post: torch.Tensor,
                       steps: torch.Tensor, editable: torch.Tensor, changed: torch.Tensor) -> torch.Tensor:
        """[R, K]: a block without masks after the step refines on: after a refinement step (`post`) that left
        unchanged less than `stability_threshold` of its decided tokens, within its budget; after a step that
        filled it, when that was before its S-th step."""
        cfg = self.cfg
        posts = state.post_steps[rows, blocks] + post.long()
        decided = editable.sum(-1)
        unstable = decided - changed.sum(-1) < cfg.stability_threshold * decided
        return torch.where(post, unstable & (posts <= cfg.max_post_steps), steps < cfg.steps_per_block)

    def stopped(self, state: DecodeState, status: BlockStatus, stop_ids: torch.Tensor) -> torch.Tensor:
        """The step wrote a stop token and nothing before the first one is undecided (a refining block stops too:
        later edits could change what precedes the stop token)."""
        hits = state.stop_hits(stop_ids)
        first, has_stop = state.first_stop(stop_ids, hits)
        return has_stop & state.wrote_stop(hits) & state.decided_before(first)


def window_policy(cfg: BlockDiffusionConfig) -> WindowPolicy:
    """The policy of a resolved config."""
    if cfg.attention == "bidirectional":
        return {"none": FullRecompute, "prefix": PrefixCache, "dual": DualCache}[cfg.approx_cache](cfg)
    if cfg.editing_threshold is not None:
        return Editing(cfg)
    if cfg.sub_block_size or cfg.first_token_on_store:
        return SubBlocks(cfg)
    if not cfg.fused_store:
        return StoreForward(cfg)
    return MultiBlock(cfg) if cfg.max_active_blocks > 1 else BlockCausal(cfg)
