"""The decode loop of DESIGN §3: prefill, then steps of window forward → scores → strategy → canvas.

One `Decoder` serves every mode. Block-causal models decode windows over the exact paged cache (single- or
multi-block; the finished blocks at a window's front are stored in the same forward, or in a forward of their own
with `fused_store=False`). Bidirectional models recompute the whole canvas, or use Fast-dLLM v1's approximate
prefix/dual cache. A window always starts at its row's committed length; rows with nothing to do sit out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import blockdiff_attention
from ..cache import PagedBlockCache
from ..config import BlockDiffusionConfig
from .decide import Decider
from .state import BlockStatus, DecodeState


@dataclass
class Window:
    rows: torch.Tensor  # [R] canvas rows in the forward
    start: torch.Tensor  # [R] first canvas position (= the row's committed length)
    q_limit: torch.Tensor  # [R, W] int32 key limit per query, 0 for padding
    valid: torch.Tensor  # [R, W] bool
    store: torch.Tensor  # [R] complete blocks at the front to commit after the forward
    commit_to: torch.Tensor | None = None  # [R] approximate caches: committed length after the forward


class Decoder:
    def __init__(self, model, cfg: BlockDiffusionConfig, state: DecodeState, backend: str, seeds: torch.Tensor):
        self.model, self.cfg, self.state, self.backend = model, cfg, state, backend
        self.decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        self.decider = Decider(cfg, model.get_output_embeddings(), seeds)
        self.causal = cfg.attention == "block_causal"
        self.guided = cfg.cfg_scale > 0
        self.cache = self._cache()
        self.num_forwards = 0
        self.carry = None  # hidden state at each row's last committed position (logit shift)
        self.stop_ids = torch.tensor(cfg.stop_ids, dtype=torch.long, device=state.canvas.device)

    def _cache(self) -> PagedBlockCache:
        cache = getattr(self.model, "_blockdiff_cache", None)
        layers = self.model.config.num_hidden_layers
        if cache is None or cache.page_size != self.cfg.page_size or cache.num_layers != layers:
            cache = PagedBlockCache(layers, self.cfg.page_size)
            self.model._blockdiff_cache = cache
        row_tokens = self.state.geometry.row_end.tolist()
        cache.start(row_tokens * 2 if self.guided else row_tokens, self.state.canvas.device)  # guidance: own rows
        return cache

    # -- forwards --------------------------------------------------------------------------------------------------

    def forward(self, window: Window):
        """Hidden states [R, W, H] of the windows (and of the unconditional canvases with guidance)."""
        rows, start, q_limit = window.rows, window.start, window.q_limit
        width = q_limit.shape[1]
        positions = (start[:, None] + torch.arange(width, device=start.device)).clamp(max=self.state.canvas.shape[1] - 1)
        tokens = self.state.canvas[rows[:, None], positions]
        valid = window.valid
        if self.guided:  # the unconditional canvases (prompt masked) run beside, in cache rows of their own
            prompt = positions < self.state.geometry.prompt_len[rows][:, None]
            tokens = torch.cat([tokens, tokens.masked_fill(prompt, self.cfg.mask_token_id)])
            rows = torch.cat([rows, rows + self.state.num_rows])
            positions, q_limit, valid = positions.repeat(2, 1), q_limit.repeat(2, 1), valid.repeat(2, 1)
        plan = self.cache.plan_forward(rows, q_limit, valid, self.backend)
        with blockdiff_attention(self.model):
            out = self.decoder(input_ids=tokens, position_ids=positions, past_key_values=self.cache, use_cache=True,
                               blockdiff_plan=plan)
        self.num_forwards += 1
        hidden = out.last_hidden_state
        return hidden.chunk(2) if self.guided else (hidden, None)

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
        window = Window(rows, torch.zeros_like(lengths), torch.where(valid, limit, 0).int(), valid, lengths)
        hidden, _ = self.forward(window)
        self._committed(rows, lengths, hidden)

    def _committed(self, rows: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        """`tokens` more positions of `rows` are final in the cache; keep the hidden state before the next one."""
        self.cache.commit(rows, tokens)
        if not self.cfg.logit_shift:
            return
        if self.carry is None:
            self.carry = hidden.new_zeros(self.state.num_rows, hidden.shape[-1])
        self.carry[rows] = hidden[torch.arange(len(rows), device=rows.device), tokens - 1]
        if self.cfg.first_token_on_store:
            self._first_token(rows)

    def _first_token(self, rows: torch.Tensor) -> None:
        """Fast-dLLM v2: the forward that stores a block also decides the next block's first token, greedily."""
        state = self.state
        position = self.cache.committed[rows]
        inside = position < state.geometry.row_end[rows]
        position = position.clamp(max=state.canvas.shape[1] - 1)
        open_ = inside & (state.canvas[rows, position] == self.cfg.mask_token_id)
        rows, position = rows[open_], position[open_]
        logits = self.decider.logits(state, rows, self.carry[rows], None)
        logits[:, self.cfg.mask_token_id] = float("-inf")
        logp = torch.log_softmax(logits, -1)
        token = logits.argmax(-1)
        entropy = -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1)
        state.commit(rows, position, token, logp.gather(1, token[:, None]).squeeze(1), entropy, self.num_forwards)

    # -- one step ----------------------------------------------------------------------------------------------------

    def step(self) -> None:
        state = self.state
        status = state.status()
        state.activate(status)
        is_added = state.block_index < state.added[:, None]
        active = is_added & ~status.complete & ~state.done[:, None]
        window = self._window(status, active)
        if window is not None:
            hidden, hidden_uncond = self.forward(window)
            self._store(window, hidden)
            self._decide(window, status, active[window.rows], hidden, hidden_uncond)
        if self.cfg.eos_fill and self.stop_ids.numel():
            state.fill_after_stop(self.stop_ids, self.num_forwards)
        status = state.status()
        state.done |= state.stopped(status, self.stop_ids) | self._finished(status)

    def _window(self, status: BlockStatus, active: torch.Tensor) -> Window | None:
        """Which rows run, and each row's window (DESIGN §3.2)."""
        state, geo, size = self.state, self.state.geometry, self.state.geometry.block_size
        store = state.leading_complete(status) if self.causal else torch.zeros_like(state.added)
        work = active.any(-1)
        if self.causal and not self.cfg.fused_store:
            work = work | (store > 0)
            active &= (store == 0)[:, None]
        rows = torch.nonzero(work & ~state.done).flatten()
        if len(rows) == 0:
            return None
        store, commit_to = store[rows], None
        if self.causal:  # from the first uncommitted block to the last added one; each query sees its block's end
            first = state.stored[rows]
            last = state.added[rows] if self.cfg.fused_store else torch.where(store > 0, first + store, state.added[rows])
            start = geo.first_block_start[rows] + first * size
            width = geo.block_end(rows, last - 1) - start
        elif self.cfg.approx_cache == "none":  # full recompute of the canvas
            start, width = torch.zeros_like(rows), geo.row_end[rows]
        else:  # Fast-dLLM v1: a full forward at each block start, then the block (dual) or block + suffix (prefix)
            block = state.added[rows] - 1
            block_start = geo.first_block_start[rows] + block * size
            fresh = state.forced_steps[rows, block] == 0
            self.cache.committed[rows[fresh]] = 0
            start = torch.where(fresh, 0, block_start)
            end = geo.row_end[rows] if self.cfg.approx_cache == "prefix" else geo.block_end(rows, block)
            width = torch.where(fresh, geo.row_end[rows], end - block_start)
            commit_to = block_start
        offsets = torch.arange(int(width.max()), device=rows.device)
        valid = offsets < width[:, None]
        if self.causal:
            limit = geo.block_end(rows, first[:, None] + offsets // size)
        else:
            limit = geo.row_end[rows][:, None].expand(-1, len(offsets))
        return Window(rows, start, torch.where(valid, limit, 0).int(), valid, store, commit_to)

    def _store(self, window: Window, hidden: torch.Tensor) -> None:
        """Commit what the forward computed from final tokens: complete front blocks, or an approximate prefix."""
        if window.commit_to is not None:
            self.cache.committed[window.rows] = window.commit_to
            return
        has_store = window.store > 0
        if not self.causal or not bool(has_store.any()):
            return
        rows, start = window.rows[has_store], window.start[has_store]
        store = window.store[has_store]
        tokens = self.state.geometry.block_end(rows, self.state.stored[rows] + store - 1) - start
        self.state.stored[rows] += store
        self._committed(rows, tokens, hidden[has_store])

    def _decide(self, window: Window, status: BlockStatus, active: torch.Tensor, hidden: torch.Tensor,
                hidden_uncond: torch.Tensor | None) -> None:
        """Gather the hidden state that predicts each slot of the active blocks and let the decider commit."""
        blocks = self.decider.active_blocks(self.state, status, window.rows, active)
        if len(blocks.rows) == 0:
            return
        width = hidden.shape[1]
        source = blocks.positions - window.start[blocks.window_rows][:, None] - int(self.cfg.logit_shift)
        index = blocks.window_rows[:, None] * width + source.clamp(0, width - 1)

        def gather(states: torch.Tensor) -> torch.Tensor:
            flat = states.reshape(-1, states.shape[-1])[index]
            if self.carry is not None:
                flat = torch.where((source < 0)[..., None], self.carry[blocks.rows][:, None], flat)
            return flat

        uncond = gather(hidden_uncond) if hidden_uncond is not None else None
        self.decider.decide(self.state, status, blocks, gather(hidden), uncond, self.num_forwards)

    def _finished(self, status: BlockStatus) -> torch.Tensor:
        state = self.state
        finished = (state.added == state.geometry.num_blocks) & status.complete.all(-1)
        if self.causal and not self.cfg.fused_store:
            finished &= state.stored == state.geometry.num_blocks
        return finished

    def run(self, streamer=None) -> None:
        self.prefill()
        while not bool(self.state.done.all()):
            self.step()
            if streamer is not None:
                streamer.step(self.state)
        if streamer is not None:
            streamer.end()
