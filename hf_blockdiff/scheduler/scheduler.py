"""The scheduler: decode state, window policy and strategy, and nothing of the model (docs/architecture.md, "Architecture").

Per step it lays out the next forward (`plan`: the block status and `forward_layout`), says what that forward
stored (`stored`), asks for scores of the undecided positions of the active blocks (`score_request`), and concludes
the step (`conclude`): flags non-finite scores (`check_scores`), turns the scores into a `Decision` it writes
(`decide`, `apply`) and prepares the step after (`end_step`). The model executor fills in hidden states and scores
between those calls. All of it is tensor ops on fixed shapes: with capacities given, a step has no host sync and can
be captured as a CUDA graph, and compiled (docs/kernels.md, "Kernels and backends": compiled bookkeeping).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import BlockDiffusionConfig
from ..kernels.rng import uniform_noise
from ..strategies.scoring import RowSampling, Scores
from ..strategies import STRATEGIES, BlockScores, StrategyParams
from .chunks import Chunks, plan_chunks
from .settings import SlotSettings
from .state import BlockStatus, DecodeState, Decision
from .windows import StoreDecision, Stored, window_policy


@dataclass
class ForwardLayout:
    """One forward: the chunks (virtual rows) of every slot's window, their tokens and per-query key limits, and the
    unconditional tokens (prompt masked) when classifier-free guidance runs them beside."""

    chunks: Chunks
    tokens: torch.Tensor  # [N, C]
    positions: torch.Tensor  # [N, C]
    key_limits: torch.Tensor  # [N, C]
    unconditional: torch.Tensor | None = None


@dataclass
class ActiveBlocks:
    """Each slot's active blocks in order, [R, K] (`valid` False past the last one), and their positions."""

    blocks: torch.Tensor  # [R, K] decode-block index (clamped)
    valid: torch.Tensor  # [R, K]
    positions: torch.Tensor  # [R, K, B]
    candidates: torch.Tensor  # [R, K, B] undecided positions the strategy may commit
    editable: torch.Tensor | None = None  # [R, K, B] decided positions an edit may replace (editing only)

    @property
    def scored(self) -> torch.Tensor:
        """[R, K, B] the positions to score: candidates, and editable ones."""
        return self.candidates if self.editable is None else self.candidates | self.editable

    @property
    def rows(self) -> torch.Tensor:
        return torch.arange(self.blocks.shape[0], device=self.blocks.device)[:, None].expand_as(self.blocks)


@dataclass
class ScoreRequest:
    """The positions to score, gathered from the [R, K, B] grid of active blocks into `pick` (fixed length inside a
    CUDA graph: `picked` marks the real ones), with each one's sampling seed, noise counter and temperature."""

    active: ActiveBlocks
    pick: torch.Tensor  # [n] flat indices into the grid
    picked: torch.Tensor  # [n] bool
    rows: torch.Tensor  # [n]
    positions: torch.Tensor  # [n]
    seeds: torch.Tensor  # [n]
    counters: torch.Tensor  # [n]
    temperature: torch.Tensor | None  # [n] per-position temperatures, or None for the config's one
    sampling: RowSampling | None  # per-row sampling settings (an engine of per-row sampling), else the config's
    canvas: torch.Tensor | None  # [R, width + 1] decided canvases, for the repetition penalty and logits processors
    needs_salience: bool
    preceding: torch.Tensor | None = None  # [n] the edit penalty's token: the one before in the block (-1: none)


class Scheduler:
    def __init__(self, cfg: BlockDiffusionConfig, slots: int, width: int, max_blocks: int, device: torch.device):
        self.cfg = cfg
        # set by the row loop before each step: some row samples by other settings than the config's, so the step
        # scores each row by its own (the general path) instead of the config's (the fused path; docs/architecture.md,
        # "Serving")
        self.per_row_sampling = False
        self.state = state = DecodeState(slots, width, max_blocks, cfg, device)
        self.policy = window_policy(cfg)
        self.strategy = STRATEGIES[cfg.strategy]
        self.params = StrategyParams(
            threshold=cfg.effective_threshold, fallback=cfg.fallback, strict=cfg.strict_threshold,
            entropy_budget=cfg.entropy_budget, relative_alpha=cfg.relative_alpha, factor=cfg.factor,
            steps=cfg.steps_per_block, dream_eps=cfg.dream_eps, forced_token_scope=cfg.forced_token_scope,
            editing_threshold=cfg.editing_threshold, remask_threshold=cfg.remask_threshold,
        )
        self.active_blocks = min(cfg.max_active_blocks, max_blocks)
        self.chunk = cfg.block_size if cfg.block_size <= 64 else 64  # tokens per virtual row
        self.stop_ids = torch.tensor(cfg.stopping_ids, dtype=torch.long, device=device)
        self.active = torch.zeros_like(state.full)  # the next forward's plan, in fixed buffers
        self.store, self.span_start, self.span_end = (torch.zeros_like(state.added) for _ in range(3))
        self.chunk_total = torch.zeros((), dtype=torch.long, device=device)
        # the branches on the config's floats taken here: traced by torch.compile a float is a symbol, and a branch
        # on it makes dynamo specialize it and trace the whole call again (docs/kernels.md, "Kernels and backends":
        # compiled bookkeeping)
        self.guided = cfg.guided
        self.penalizes_edits = bool(cfg.edit_penalty)
        self.reads_canvas = cfg.repetition_penalty != 1.0 or cfg.logits_processor is not None
        # T_i = T·(1 + slope·i/(B−1)) for block offset i, computed here once, eagerly: in a compiled step inductor
        # would divide by B−1 as a product with its reciprocal, 1 ulp off on some offsets
        self.position_temperature = None
        if cfg.pos_temp_slope and cfg.temperature > 0:
            offsets, span = torch.arange(cfg.block_size, device=device).float(), max(cfg.block_size - 1, 1)
            self.position_temperature = cfg.temperature * (1 + cfg.pos_temp_slope * offsets / span)

    @property
    def num_forwards(self) -> int:
        return int(self.state.forward_index)

    def chunk_bound(self) -> int | None:
        """The most chunks one slot's window can need in any step, where the mode bounds it."""
        if self.active_blocks > 1:
            return None
        return self.policy.chunk_bound(self.state.block_size, self.chunk)

    # -- admission ---------------------------------------------------------------------------------------------------

    def start_call(self) -> None:
        self.state.start_call()

    def admit(self, slots: torch.Tensor, prompts: list[torch.Tensor], seeds: torch.Tensor,
              settings: list[SlotSettings]) -> None:
        self.state.load(slots, prompts, seeds, settings)

    def prefill_layout(self, slots: torch.Tensor, chunk_size: int, computed: torch.Tensor | None = None,
                       start: torch.Tensor | None = None) -> tuple[ForwardLayout | None, Stored] | None:
        """The forward that writes the prefix before the first decode block of `slots` into the cache (only of the
        slots in `computed` when given, the others reuse a prefix already there; from `start` [R] on where given:
        the cache holds what precedes it), and what the slots then hold stored; None when the mode caches no prefix
        or the slots have none; the layout is None when nothing is left to compute."""
        state = self.state
        if not self.policy.prefills:
            return None
        chosen = torch.zeros_like(state.done)
        chosen[slots] = True
        end = torch.where(chosen, state.first_block_start, 0)
        if not bool((end > 0).any()):
            return None
        stored = Stored(end > 0, end, torch.zeros_like(end))
        if computed is not None:
            chosen.zero_()
            chosen[computed] = True
            end = torch.where(chosen, end, 0)
        begin = torch.zeros_like(end) if start is None else torch.minimum(start, end)
        if not bool((end > begin).any()):
            return None, stored
        state.count_forward(1)
        return self._layout(plan_chunks(begin, end, chunk_size)), stored

    # -- one step ----------------------------------------------------------------------------------------------------

    def has_work(self) -> bool:
        """Whether the prepared forward has any chunk (a host sync)."""
        return bool(self.chunk_total)

    def plan(self, capacity: int | None) -> tuple[BlockStatus, ForwardLayout]:
        """A step's start: the canvas's block status and the prepared forward, in `capacity` chunks."""
        return self.state.status(), self.forward_layout(capacity)

    def forward_layout(self, capacity: int | None) -> ForwardLayout:
        """The prepared forward, in `capacity` chunks (None: as many as needed). A fixed-shape forward with nothing
        to do is not counted."""
        self.state.count_forward(self.chunk_total > 0)
        return self._layout(plan_chunks(self.span_start, self.span_end, self.chunk, capacity))

    def _layout(self, chunks: Chunks) -> ForwardLayout:
        state = self.state
        positions = chunks.positions.clamp(max=state.width)
        tokens = state.canvas[chunks.rows[:, None], positions]
        unconditional = None
        if self.guided:
            prompt = positions < state.prompt_len[chunks.rows][:, None]
            unconditional = tokens.masked_fill(prompt, self.cfg.mask_token_id)
        return ForwardLayout(chunks, tokens, positions, self.policy.key_limits(state, chunks), unconditional)

    def stored(self, chunks: Chunks) -> Stored | None:
        """What the forward over `chunks` committed to the cache; the state counts the stored blocks."""
        stored = self.policy.stored(self.state, chunks, self.store)
        if stored is not None:
            self.state.mark_stored(stored.blocks)
        return stored

    def store_decision(self, stored: Stored) -> StoreDecision | None:
        """Positions the forward that stored blocks decides (the mode's `store_decision`)."""
        return self.policy.store_decision(self.state, stored)

    def score_request(self, status: BlockStatus, capacity: int | None) -> ScoreRequest:
        """The undecided (and, with editing, editable) positions of the active blocks, `capacity` of them (None:
        exactly those)."""
        state = self.state
        active = self._active_blocks(status)
        rows_all = active.rows[..., None].expand_as(active.positions)
        flat = active.scored.reshape(-1)
        if capacity is None:
            pick = torch.nonzero(flat).flatten()
        else:
            pick = torch.sort((~flat).to(torch.int8), stable=True).indices[:capacity]
        rows, positions = rows_all.reshape(-1)[pick], active.positions.reshape(-1)[pick]
        offsets = pick % active.positions.shape[-1]
        temperature = None if self.position_temperature is None else self.position_temperature[offsets]
        preceding = None
        if self.penalizes_edits:
            before = state.canvas[rows, (positions - 1).clamp(0, state.width)]
            preceding = torch.where(offsets > 0, before, -1)
        sampling = None
        if self.per_row_sampling:
            sampling = RowSampling(state.inverse_temperature[rows], state.top_k[rows], state.top_p_drop[rows])
        return ScoreRequest(active, pick, flat[pick], rows, positions, state.seed[rows],
                            self.counter(rows, positions), temperature, sampling, self.context(),
                            "salience" in self.strategy.needs, preceding)

    def context(self) -> torch.Tensor | None:
        """The decided canvases, where a repetition penalty or logits processor reads them (None otherwise)."""
        if not self.reads_canvas:
            return None
        return self.state.decided_canvas()

    def counter(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Noise counter of (slot, position) at this step: unique per position and per step of the slot."""
        return positions * 65599 + self.state.draws[rows]

    def _active_blocks(self, status: BlockStatus) -> ActiveBlocks:
        state, never = self.state, self.active.shape[1]
        blocks = torch.sort(torch.where(self.active, state.block_index, never), dim=1).values[:, : self.active_blocks]
        valid = blocks < never
        blocks = blocks.clamp(max=never - 1)
        rows = torch.arange(len(blocks), device=blocks.device)[:, None]
        candidates = self.policy.candidates(status.masked[rows, blocks] & valid[..., None])
        editable = self.policy.editable(state, status, rows, blocks, valid)
        return ActiveBlocks(blocks, valid, state.positions[rows, blocks], candidates, editable)

    def decide(self, request: ScoreRequest, status: BlockStatus, scores: Scores) -> Decision:
        """The strategy's choice among the candidates, with the bookkeeping it keeps."""
        state, active = self.state, request.active
        shape, flat_size = active.candidates.shape, active.candidates.numel()
        target = torch.where(request.picked, request.pick, flat_size)  # padding rows land past the end

        def grid(values: torch.Tensor, fill) -> torch.Tensor:
            out = torch.full((flat_size + 1,), fill, dtype=values.dtype, device=values.device)
            out[target] = values
            return out[:-1].view(shape)

        block_scores = self._block_scores(request, status, grid, scores)
        transfer = self.strategy.select(block_scores, self.params).view(shape) & active.candidates
        forced = block_scores.forced.view(active.blocks.shape)
        return Decision(
            rows=active.rows[..., None].expand_as(active.positions), positions=active.positions,
            tokens=grid(scores.proposal, 0), logprob=grid(scores.logprob.float(), 0.0),
            entropy=grid(scores.entropy.float(), 0.0),
            proposal_rows=request.rows, proposals=scores.proposal,
            proposal_positions=torch.where(request.picked, request.positions, state.width),
            forced_rows=active.rows, forced_blocks=active.blocks, forced=forced, stepped=active.valid.any(-1),
            **self._edits(active, status, block_scores, transfer, forced),
        )

    def _edits(self, active: ActiveBlocks, status: BlockStatus, block_scores: BlockScores, transfer: torch.Tensor,
               forced: torch.Tensor) -> dict:
        """The Decision's commit and, when the mode edits, editing fields."""
        if active.editable is None:
            return dict(commit=transfer)
        return self.policy.edit_decision(self.state, status, active, block_scores, self.params, transfer, forced)

    def _block_scores(self, request: ScoreRequest, status: BlockStatus, grid, scores: Scores) -> BlockScores:
        state, active = self.state, request.active
        rows, blocks = active.rows, active.blocks
        full = state.full[rows, blocks] & active.valid
        forced = full & (torch.cumsum(full.long(), dim=1) == 1)  # the lowest fully-activated active block
        width = active.candidates.shape[-1]
        block_scores = BlockScores(
            masked=active.candidates.view(-1, width),
            confidence=grid(scores.confidence.float(), 0.0).view(-1, width),
            entropy=grid(scores.entropy.float(), float("inf")).view(-1, width),
            margin=grid(scores.margin.float(), 0.0).view(-1, width),
            scheduled=state.schedule(rows, blocks, status.remaining[rows, blocks]).view(-1),
            forced=forced.view(-1),
            step=state.forced_steps[rows, blocks].view(-1),
            proposal=grid(scores.proposal, -1).view(-1, width),
            slot_blocks=blocks.shape[1],
            threshold=state.threshold[rows].view(-1, 1),
            log_threshold=state.log_threshold[rows].view(-1, 1),
        )
        needs = self.strategy.needs
        positions = active.positions.clamp(max=state.width)
        if "previous" in needs:
            block_scores.previous = state.previous[rows[..., None], positions].view(-1, width)
        if "salience" in needs:
            block_scores.salience = grid(scores.salience, float("-inf")).view(-1, width)
        if active.editable is not None:
            block_scores.editable = active.editable.view(-1, width)
            block_scores.current = state.canvas[rows[..., None], positions].view(-1, width)
        if "noise" in needs:
            counter = self.counter(rows[..., None].expand_as(positions), positions)
            seeds = state.seed[rows][..., None].expand_as(positions)
            block_scores.noise = uniform_noise(seeds.reshape(-1), counter.reshape(-1), 1).view(-1, width)
        return block_scores

    def apply(self, decision: Decision) -> None:
        self.state.apply(decision)

    def conclude(self, request: ScoreRequest, status: BlockStatus, scores: Scores) -> None:
        """A step's end: flag non-finite scores, write the strategy's decision, prepare the next forward."""
        self.check_scores(request, scores)
        self.apply(self.decide(request, status, scores))
        self.end_step()

    def end_step(self) -> None:
        """Mark finished slots, then prepare the next forward of the others."""
        state = self.state
        self.prepare(~state.done, self._finish(state.status()))

    def _finish(self, status: BlockStatus) -> BlockStatus:
        """Mark the slots that are done; returns the canvas's status (after the EOS fill, if any)."""
        state = self.state
        if self.cfg.eos_fill and self.stop_ids.numel():
            state.fill_after_stop(self.stop_ids)
            status = state.status()
        finished = self.policy.finished(state, status)
        if self.stop_ids.numel():
            finished |= self.policy.stopped(state, status, self.stop_ids)
        if self.cfg.max_forwards is not None:  # request limits (docs/architecture.md, "The decode loop")
            finished |= state.draws >= self.cfg.max_forwards
        if self.cfg.max_repeat_run is not None:
            finished |= state.repeat_end(self.cfg.max_repeat_run)[1]
        state.finish(finished)
        return status

    def output_end(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's last output position and whether it has one: its first stop token, or the end of its first
        run of `max_repeat_run` equal tokens, whichever comes first (what follows becomes the pad id)."""
        end, has = self.state.first_stop(self.stop_ids)
        if self.cfg.max_repeat_run is not None:
            run_end, repeats = self.state.repeat_end(self.cfg.max_repeat_run)
            end = torch.where(has & (~repeats | (end <= run_end)), end, run_end)
            has = has | repeats
        return end, has

    def prepare(self, slots: torch.Tensor, status: BlockStatus | None = None) -> None:
        """Decide the next forward of `slots` ([R] bool): activate blocks and lay out their windows, in fixed buffers
        (so a captured step can prepare its successor); `chunk_total` is its size."""
        state = self.state
        status = status or state.status()
        state.activate(status, slots)
        is_added = state.block_index < state.added[:, None]
        active = is_added & ~status.complete & ~state.done[:, None]
        store = self.policy.store_count(state, status)
        active = self.policy.decoding(active, store)
        start, end = self.policy.spans(state, status, active, store)
        for buffer, value in ((self.active, active), (self.store, store), (self.span_start, start),
                              (self.span_end, end)):
            buffer.copy_(torch.where(slots.view(-1, *[1] * (value.dim() - 1)), value, buffer))
        lengths = (self.span_end - self.span_start).clamp(min=0)
        self.chunk_total.copy_(((lengths + self.chunk - 1) // self.chunk).sum())

    # -- what the host reads -----------------------------------------------------------------------------------------

    def check_scores(self, request: ScoreRequest, scores: Scores) -> None:
        """Flag the slots whose scores are inf or nan (overflowed or NaN hidden states): no strategy can be trusted
        with them, and a threshold strategy would wait for them forever."""
        bad = request.picked & ~torch.isfinite(scores.confidence.float())
        count = torch.zeros_like(self.state.added).index_put_((request.rows,), bad.long(), accumulate=True)
        self.state.mark_nonfinite(count > 0)

    def host_view(self) -> tuple[list[bool], list[int], list[int], list[int], int]:
        """In one read: each slot's done flag, the forward of its first non-finite scores (-1: none), how many of
        its generated positions are decided and its decoding steps, and the forwards so far (`num_forwards`)."""
        state = self.state
        decided = ((state.commit_step >= 0) & state.generated()).sum(-1)
        forwards = state.forward_index.expand_as(decided)
        done, nonfinite, decided, draws, forwards = torch.stack([state.done.long(), state.nonfinite, decided,
                                                                 state.draws, forwards]).tolist()
        return [bool(flag) for flag in done], nonfinite, decided, draws, forwards[0]

    def committed_end(self) -> torch.Tensor:
        """[R] canvas end of each slot's committed output: its generated tokens decided with all before them (with
        editing, only those of complete blocks, which no edit changes any more), up to its stop token."""
        state = self.state
        undecided = state.generated() & (state.canvas == self.cfg.mask_token_id)
        end = torch.where(undecided.any(-1), undecided.int().argmax(-1), state.prompt_len + state.max_new)
        if self.cfg.editing_threshold is not None:
            incomplete = ~state.status().complete
            block_end = state.first_block_start + incomplete.int().argmax(-1) * state.block_size
            end = torch.where(incomplete.any(-1), torch.minimum(end, block_end), end)
        stop, has_stop = self.output_end()
        return torch.where(has_stop, torch.minimum(end, stop + 1), end)

    def retire(self, slot: int) -> None:
        """`slot` decodes no further (cancelled, or stopped on the host): done, with nothing planned."""
        retired = torch.zeros_like(self.state.done)
        retired[slot] = True
        self.state.finish(retired)
        self.prepare(retired)
