"""The decode loop of DESIGN §3: prefill, then steps of window forward → scores → strategy → canvas.

One `Decoder` serves every mode. Block-causal models decode windows over the exact paged cache (single- or
multi-block; the finished blocks at a window's front are stored in the same forward, or in a forward of their own
with `fused_store=False`). Bidirectional models recompute the whole canvas, or use Fast-dLLM v1's approximate
prefix/dual cache. A step is tensor ops on fixed shapes: eagerly it sizes the forward to the windows (a host sync),
inside a CUDA graph to fixed capacities.
"""

from __future__ import annotations

import torch

from ..attention import blockdiff_attention
from ..cache import PagedBlockCache
from ..config import BlockDiffusionConfig
from .chunks import Chunks, plan_chunks
from .decide import Decider
from .state import BlockStatus, DecodeState

PREFILL_CHUNK = 128


class Decoder:
    def __init__(self, model, cfg: BlockDiffusionConfig, state: DecodeState, cache: PagedBlockCache, backend: str,
                 seeds: torch.Tensor, fusion: str):
        self.model, self.cfg, self.state, self.cache, self.backend = model, cfg, state, cache, backend
        self.fusion = fusion
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        self.decider = Decider(cfg, model.get_output_embeddings(), seeds)
        self.causal = cfg.attention == "block_causal"
        self.guided = cfg.cfg_scale > 0
        self.active_blocks = min(cfg.max_active_blocks, state.full.shape[1])
        self.chunk = cfg.block_size if cfg.block_size <= 64 else 64
        self.stop_ids = torch.tensor(cfg.stop_ids, dtype=torch.long, device=state.canvas.device)
        hidden = model.config.get_text_config().hidden_size
        dtype = model.get_output_embeddings().weight.dtype
        device = state.canvas.device
        self.carry = torch.zeros(state.num_rows, hidden, dtype=dtype, device=device)
        self.active = torch.zeros_like(state.full)
        self.store, self.span_start, self.span_end = (torch.zeros_like(state.added) for _ in range(3))
        self.chunk_total = torch.zeros((), dtype=torch.long, device=device)

    @property
    def num_forwards(self) -> int:
        return int(self.state.forward_index)

    # -- forwards --------------------------------------------------------------------------------------------------

    def forward(self, chunks: Chunks, q_limit: torch.Tensor):
        """Flat hidden states [N·C, H] of the chunks (and of the unconditional canvases with guidance)."""
        state = self.state
        positions = chunks.positions.clamp(max=state.width)
        tokens = state.canvas[chunks.rows[:, None], positions]
        rows, valid = chunks.rows, chunks.valid
        if self.guided:  # the unconditional canvases (prompt masked) run beside, in cache rows of their own
            prompt = positions < state.prompt_len[rows][:, None]
            tokens = torch.cat([tokens, tokens.masked_fill(prompt, self.cfg.mask_token_id)])
            rows = torch.cat([rows, rows + state.num_rows])
            positions, q_limit, valid = positions.repeat(2, 1), q_limit.repeat(2, 1), valid.repeat(2, 1)
        plan = self.cache.plan_forward(rows, positions, valid, q_limit.int(), self.backend)
        with blockdiff_attention(self.model, self.fusion):
            out = self.decoder(input_ids=tokens, position_ids=positions, past_key_values=self.cache, use_cache=True,
                               blockdiff_plan=plan)
        hidden = out.last_hidden_state.reshape(-1, out.last_hidden_state.shape[-1])
        return hidden.chunk(2) if self.guided else (hidden, None)

    def key_limits(self, chunks: Chunks) -> torch.Tensor:
        """Per-query key limits: the end of the query's block (block-causal) or of the canvas (bidirectional)."""
        if self.causal:
            limit = self.state.key_limit(chunks.rows, chunks.positions)
        else:
            limit = self.state.row_end[chunks.rows][:, None].expand_as(chunks.positions)
        return torch.where(chunks.valid, limit, 0)

    def prefill(self, slots: torch.Tensor) -> None:
        """Write the prefix before the first decode block of `slots` into the cache (block-causal models)."""
        state = self.state
        if not self.causal:
            return
        chosen = torch.zeros_like(state.done)
        chosen[slots] = True
        end = torch.where(chosen, state.first_block_start, 0)
        if not bool((end > 0).any()):
            return
        size = self.chunk if self.backend == "flash_attn" else PREFILL_CHUNK  # flash: one key length per row
        chunks = plan_chunks(torch.zeros_like(end), end, size)
        state.forward_index += 1
        hidden, _ = self.forward(chunks, self.key_limits(chunks))
        self._committed(chunks, end > 0, end, hidden)

    def _committed(self, chunks: Chunks, has: torch.Tensor, new_length: torch.Tensor, hidden: torch.Tensor) -> None:
        """Slots `has` now have `new_length` final positions in the cache; keep the hidden state before the next."""
        rows = torch.arange(len(has), device=has.device)
        self.cache.commit(rows, torch.where(has, new_length - self.cache.committed[rows], 0))
        if not self.cfg.logit_shift:
            return
        index, _ = chunks.locate(rows, new_length - 1)
        self.carry.copy_(torch.where(has[:, None], hidden[index], self.carry))
        if self.cfg.first_token_on_store:
            self._first_token(has)

    def _first_token(self, has: torch.Tensor) -> None:
        """Fast-dLLM v2: the forward that stores a block also decides the next block's first token, greedily."""
        state = self.state
        rows = torch.arange(state.num_rows, device=has.device)
        position = self.cache.committed[rows].clamp(max=state.width)
        open_ = has & (position < state.row_end) & (state.canvas[rows, position] == self.cfg.mask_token_id)
        logits = self.decider.logits(state, rows, self.carry, None).float()
        logits[:, self.cfg.mask_token_id] = float("-inf")
        logp = torch.log_softmax(logits, -1)
        token = logits.argmax(-1)
        entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
        state.commit(rows, position, token, logp.gather(1, token[:, None]).squeeze(1), entropy, open_)

    # -- one step ----------------------------------------------------------------------------------------------------

    def prepare(self, slots: torch.Tensor, status: BlockStatus | None = None) -> None:
        """Decide the next forward of `slots` ([R] bool): activate blocks and lay out their windows. The plan lives
        in fixed buffers, so a captured step can prepare its successor; `chunk_total` is its size. `status` is the
        canvas's current one when the caller has it."""
        state = self.state
        status = status or state.status()
        state.activate(status, slots)
        is_added = state.block_index < state.added[:, None]
        active = is_added & ~status.complete & ~state.done[:, None]
        store = state.leading_complete(status) if self.causal else torch.zeros_like(state.added)
        if self.causal and not self.cfg.fused_store:
            active &= (store == 0)[:, None]
        start, end = self._spans(status, active, store)
        for buffer, value in ((self.active, active), (self.store, store), (self.span_start, start),
                              (self.span_end, end)):
            buffer.copy_(torch.where(slots.view(-1, *[1] * (value.dim() - 1)), value, buffer))
        lengths = (self.span_end - self.span_start).clamp(min=0)
        self.chunk_total.copy_(((lengths + self.chunk - 1) // self.chunk).sum())

    def advance(self, chunk_capacity: int | None = None, logit_capacity: int | None = None) -> None:
        """Run the prepared forward and its decisions, then prepare the next one. Capacities fix the shapes (CUDA
        graphs); None sizes them to this step (a host sync) and skips the forward when no slot works."""
        state = self.state
        if chunk_capacity is not None or bool(self.chunk_total):
            status = state.status()
            chunks = plan_chunks(self.span_start, self.span_end, self.chunk, chunk_capacity)
            state.forward_index += self.chunk_total > 0  # a fixed-shape step with nothing to do is not a forward
            hidden, hidden_uncond = self.forward(chunks, self.key_limits(chunks))
            self._store(chunks, self.store, hidden)
            blocks = self.decider.active_blocks(state, status, self.active, self.active_blocks)

            def hidden_at(rows: torch.Tensor, positions: torch.Tensor):
                source = positions - int(self.cfg.logit_shift)
                index, inside = chunks.locate(rows, source)
                conditional = torch.where(inside[:, None], hidden[index], self.carry[rows])
                return conditional, None if hidden_uncond is None else hidden_uncond[index]

            self.decider.decide(state, status, blocks, hidden_at, logit_capacity)
        self.prepare(~state.done, self._finish(state.status()))

    def chunk_bound(self) -> int | None:
        """The most chunks one slot's window can need in any step, where the mode bounds it: single-block
        block-causal decoding works on its block and, with the fused store, the finished block before it."""
        if not self.causal or self.active_blocks > 1:
            return None
        return -(-self.state.block_size // self.chunk) * (2 if self.cfg.fused_store else 1)

    def _spans(self, status: BlockStatus, active: torch.Tensor, store: torch.Tensor):
        """Each slot's window [start, end) (DESIGN §3.2); empty for slots with nothing to do."""
        state, cfg, size = self.state, self.cfg, self.state.block_size
        rows = torch.arange(state.num_rows, device=active.device)
        work = active.any(-1)
        if self.causal:  # from the first uncommitted block to the last added one
            first = state.stored
            last = state.added if cfg.fused_store else torch.where(store > 0, first + store, state.added)
            work = work | (store > 0) & (not cfg.fused_store)
            start = state.first_block_start + first * size
            end = state.block_end(rows, (last - 1).clamp(min=0))
        elif cfg.approx_cache == "none":  # full recompute of the canvas
            start, end = torch.zeros_like(rows), state.row_end
        else:  # Fast-dLLM v1: the whole canvas at each block start, then the block (dual) or block + suffix (prefix)
            block = (state.added - 1).clamp(min=0)
            block_start = state.first_block_start + block * size
            fresh = state.forced_steps[rows, block] == 0
            start = torch.where(fresh, 0, block_start)
            end = torch.where(fresh | (cfg.approx_cache == "prefix"), state.row_end, state.block_end(rows, block))
        work = work & ~state.done
        return start, torch.where(work, end, start)

    def _store(self, chunks: Chunks, store: torch.Tensor, hidden: torch.Tensor) -> None:
        """Commit what the forward computed from final tokens: complete front blocks, or an approximate prefix."""
        state = self.state
        rows = torch.arange(state.num_rows, device=store.device)
        if self.causal:
            has = (store > 0) & (chunks.end > chunks.start)
            length = state.block_end(rows, (state.stored + store - 1).clamp(min=0))
            state.stored += torch.where(has, store, 0)
            self._committed(chunks, has, length, hidden)
        elif self.cfg.approx_cache != "none":  # a block-start forward: the prefix is as final as it gets
            block_start = state.first_block_start + (state.added - 1).clamp(min=0) * state.block_size
            fresh = (chunks.start == 0) & (chunks.end > chunks.start)
            self._committed(chunks, fresh, block_start, hidden)

    def _finish(self, status: BlockStatus) -> BlockStatus:
        """Mark the slots that are done; returns the canvas's status (after the EOS fill, if any)."""
        state = self.state
        if self.cfg.eos_fill and self.stop_ids.numel():
            state.fill_after_stop(self.stop_ids)
            status = state.status()
        finished = (state.added == state.num_blocks) & status.complete.all(-1)
        if self.causal and not self.cfg.fused_store:
            finished &= state.stored == state.num_blocks
        if self.stop_ids.numel():
            finished |= state.stopped(status, self.stop_ids)
        state.done |= finished
        return status
