"""The decode loop of DESIGN §3: prefill, then steps of window forward → scores → strategy → canvas.

One `Decoder` serves every mode: block-causal windows over the paged cache (single- or multi-block, fused store or
a separate store forward) and bidirectional full recompute. Rows that have nothing to do are left out of a forward.
"""

from __future__ import annotations

import torch

from ..attention import blockdiff_attention
from ..cache import ForwardPlan, PagedBlockCache
from ..config import BlockDiffusionConfig
from ..scoring import SamplingParams, score_logits
from ..strategies import STRATEGIES, BlockScores, StrategyParams
from .state import DecodeState


class Decoder:
    def __init__(self, model, cfg: BlockDiffusionConfig, state: DecodeState, backend: str, seeds: torch.Tensor):
        self.model, self.cfg, self.state, self.backend, self.seeds = model, cfg, state, backend, seeds
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        self.lm_head = model.get_output_embeddings()
        self.causal = cfg.attention == "block_causal"
        self.cache = self._cache() if self.causal else None
        self.num_forwards = 0
        self.carry = None  # hidden state of each row's last committed position (logit shift)
        self.stop_ids = torch.tensor(cfg.stop_ids, dtype=torch.long, device=state.canvas.device)
        self.strategy = STRATEGIES[cfg.strategy]
        self.strategy_params = StrategyParams(cfg.effective_threshold, cfg.fallback)
        self.sampling = SamplingParams(cfg.mask_token_id, cfg.temperature, cfg.top_k, cfg.top_p)

    def _cache(self) -> PagedBlockCache:
        cache = getattr(self.model, "_blockdiff_cache", None)
        layers = self.model.config.num_hidden_layers
        if cache is None or cache.page_size != self.cfg.page_size or cache.num_layers != layers:
            cache = PagedBlockCache(layers, self.cfg.page_size)
            self.model._blockdiff_cache = cache
        cache.start(self.state.geometry.row_end.tolist(), self.state.canvas.device)
        return cache

    # -- forwards --------------------------------------------------------------------------------------------------

    def forward(self, rows: torch.Tensor, start: torch.Tensor, q_limit: torch.Tensor, valid: torch.Tensor):
        """Hidden states [R, W, H] of the window of `rows` starting at canvas position `start`."""
        width = q_limit.shape[1]
        positions = start[:, None] + torch.arange(width, device=start.device)
        last = self.state.canvas.shape[1] - 1
        tokens = self.state.canvas[rows[:, None], positions.clamp(max=last)]
        if self.causal:
            plan = self.cache.plan_forward(rows, q_limit, valid, self.backend)
        else:
            plan = ForwardPlan(q_limit, self.backend)
        with blockdiff_attention(self.model):
            out = self.decoder(
                input_ids=tokens,
                position_ids=positions.clamp(max=last),
                past_key_values=self.cache,
                use_cache=self.causal,
                blockdiff_plan=plan,
            )
        self.num_forwards += 1
        return out.last_hidden_state

    def prefill(self) -> None:
        """Write the prefix before each row's first decode block into the cache (block-causal models only)."""
        geo = self.state.geometry
        rows = torch.nonzero(geo.first_block_start > 0).flatten()
        if not self.causal or len(rows) == 0:
            return
        lengths = geo.first_block_start[rows]
        offsets = torch.arange(int(lengths.max()), device=rows.device)
        valid = offsets < lengths[:, None]
        if self.cfg.alignment == "absolute":
            limit = (offsets // geo.block_size + 1) * geo.block_size
        else:
            limit = lengths[:, None].expand(-1, len(offsets))
        hidden = self.forward(rows, torch.zeros_like(lengths), torch.where(valid, limit, 0).int(), valid)
        self.cache.commit(rows, lengths)
        self._carry(rows, hidden, lengths - 1)

    def _carry(self, rows: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor) -> None:
        if not self.cfg.logit_shift:
            return
        if self.carry is None:
            self.carry = hidden.new_zeros(self.state.num_rows, hidden.shape[-1])
        self.carry[rows] = hidden[torch.arange(len(rows), device=rows.device), index]

    # -- one step ----------------------------------------------------------------------------------------------------

    def step(self) -> None:
        state = self.state
        status = state.status()
        state.activate(status)
        is_added = state.block_index < state.added[:, None]
        active = is_added & ~status.complete & ~state.done[:, None]
        store = state.leading_complete(status) if self.causal else torch.zeros_like(state.added)
        if self.causal and not self.cfg.fused_store:
            active &= (store == 0)[:, None]
            work = active.any(-1) | (store > 0)
        else:
            work = active.any(-1)
        rows = torch.nonzero(work & ~state.done).flatten()
        if len(rows):
            start, q_limit, valid = self._window(rows, store[rows])
            hidden = self.forward(rows, start, q_limit, valid)
            self._store(rows, start, store[rows], hidden)
            self._decide(rows, start, hidden, status, active[rows])
        status = state.status()
        state.done |= state.stopped(status, self.stop_ids) | self._finished(status)

    def _window(self, rows: torch.Tensor, store: torch.Tensor):
        """Start, per-query key limits and validity of each row's window.

        Block-causal: the blocks from the first uncommitted one to the last added one (only the complete ones when
        a separate store forward is due); each query sees up to the end of its block. Bidirectional: the canvas."""
        state, geo, size = self.state, self.state.geometry, self.state.geometry.block_size
        if self.causal:
            first = state.stored[rows]
            end_block = state.added[rows] if self.cfg.fused_store else torch.where(store > 0, first + store, state.added[rows])
            start = geo.first_block_start[rows] + first * size
            width = geo.block_end(rows, end_block - 1) - start
        else:
            start = torch.zeros_like(rows)
            width = geo.row_end[rows]
        offsets = torch.arange(int(width.max()), device=rows.device)
        valid = offsets < width[:, None]
        if self.causal:
            limit = geo.block_end(rows, first[:, None] + offsets // size)
        else:
            limit = width[:, None].expand(-1, len(offsets))
        return start, torch.where(valid, limit, 0).int(), valid

    def _store(self, rows: torch.Tensor, start: torch.Tensor, store: torch.Tensor, hidden: torch.Tensor) -> None:
        """Commit the complete blocks at the front of the windows just computed."""
        has_store = store > 0
        if not self.causal or not bool(has_store.any()):
            return
        geo = self.state.geometry
        tokens = torch.where(has_store, geo.block_end(rows, self.state.stored[rows] + store - 1) - start, 0)
        self.cache.commit(rows, tokens)
        self.state.stored[rows] += store
        self._carry(rows[has_store], hidden[has_store], tokens[has_store] - 1)

    def _finished(self, status) -> torch.Tensor:
        state = self.state
        all_added = state.added == state.geometry.num_blocks
        decided = status.complete.all(-1)
        if self.causal and not self.cfg.fused_store:
            return all_added & decided & (state.stored == state.geometry.num_blocks)
        return all_added & decided

    def _decide(self, rows, start, hidden, status, active) -> None:
        """Score the masked positions of the active blocks of `rows` and commit what the strategy picks."""
        state, geo = self.state, self.state.geometry
        local, blocks = torch.nonzero(active, as_tuple=True)
        if len(local) == 0:
            return
        block_rows = rows[local]
        positions = geo.positions[block_rows, blocks]
        masked = status.masked[block_rows, blocks]
        source = positions - start[local, None] - int(self.cfg.logit_shift)
        width = hidden.shape[1]
        flat = hidden.reshape(-1, hidden.shape[-1])[local[:, None] * width + source.clamp(0, width - 1)]
        if self.carry is not None:
            flat = torch.where((source < 0)[..., None], self.carry[block_rows][:, None], flat)
        pick_rows, pick_cols = torch.nonzero(masked, as_tuple=True)
        logits = self.lm_head(flat[pick_rows, pick_cols])
        counter = positions[pick_rows, pick_cols] * 65599 + state.draws[block_rows[pick_rows]]
        scores = score_logits(logits, self.sampling, self.seeds[block_rows[pick_rows]], counter)

        def grid(values: torch.Tensor, fill: float) -> torch.Tensor:
            out = torch.full(masked.shape, fill, dtype=values.dtype, device=values.device)
            out[pick_rows, pick_cols] = values
            return out

        forced = self._forced(block_rows, blocks)
        remaining = status.remaining[block_rows, blocks]
        block_scores = BlockScores(
            masked=masked,
            confidence=grid(scores.confidence, 0.0),
            entropy=grid(scores.entropy, float("inf")),
            margin=grid(scores.margin, 0.0),
            scheduled=state.schedule(block_rows, blocks, remaining),
            forced=forced,
        )
        transfer = self.strategy.select(block_scores, self.strategy_params) & masked
        state.forced_steps[block_rows[forced], blocks[forced]] += 1
        state.draws[rows] += active.any(-1).long()
        t_rows, t_cols = torch.nonzero(transfer, as_tuple=True)
        canvas_rows, canvas_pos = block_rows[t_rows], positions[t_rows, t_cols]
        state.canvas[canvas_rows, canvas_pos] = grid(scores.proposal, 0)[t_rows, t_cols]
        state.commit_step[canvas_rows, canvas_pos] = self.num_forwards
        state.logprob[canvas_rows, canvas_pos] = grid(scores.logprob, 0.0)[t_rows, t_cols]
        state.entropy[canvas_rows, canvas_pos] = grid(scores.entropy, 0.0)[t_rows, t_cols]

    def _forced(self, block_rows: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """The lowest fully-activated block of each row among the scored ones must make progress."""
        full = self.state.full[block_rows, blocks]
        candidate = torch.where(full, blocks, torch.iinfo(torch.long).max)
        lowest = torch.full((self.state.num_rows,), torch.iinfo(torch.long).max, device=blocks.device)
        lowest = lowest.scatter_reduce(0, block_rows, candidate, reduce="amin")
        return full & (blocks == lowest[block_rows])

    def run(self, streamer=None) -> None:
        self.prefill()
        while not bool(self.state.done.all()):
            self.step()
            if streamer is not None:
                streamer.step(self.state)
        if streamer is not None:
            streamer.end()
