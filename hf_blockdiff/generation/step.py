"""One decode step, top to bottom (docs/design.md, "Architecture").

    layout  = scheduler.forward_layout()       which tokens run, where their keys are
    hidden  = executor.forward(layout)         the HF forward over the paged cache
    stored  = scheduler.stored(...)            what that forward committed ...
              executor.commit(stored, ...)     ... advances the cache (and Fast-dLLM v2 decides a first token)
    request = scheduler.score_request(...)     the undecided positions of the active blocks
    scores  = executor.score(request, ...)     LM head, guidance, processors, proposal/confidence/entropy
              scheduler.check_scores(...)      flags slots whose scores are inf/nan (the call then fails)
    scheduler.apply(scheduler.decide(...))     the strategy's Decision, written by the state's one writer
    scheduler.end_step()                       finished slots, and the next forward's plan

With capacities given every shape is fixed and nothing syncs with the host, so the step can be captured as a CUDA
graph (`graphs.StepGraphs`); without, it is sized to the work and skips the forward when no slot has any.
"""

from __future__ import annotations

import torch

from ..scheduler import Decision, ForwardLayout, Scheduler, Stored
from .executor import ModelExecutor
from .pages import Admission


class DecodeStep:
    def __init__(self, scheduler: Scheduler, executor: ModelExecutor):
        self.scheduler, self.executor = scheduler, executor

    def __call__(self, chunk_capacity: int | None = None, logit_capacity: int | None = None) -> None:
        scheduler, executor = self.scheduler, self.executor
        if chunk_capacity is not None or scheduler.has_work():
            status = scheduler.state.status()
            layout = scheduler.forward_layout(chunk_capacity)
            hidden, hidden_uncond = executor.forward(layout)
            self._store(layout, scheduler.stored(layout.chunks), hidden)
            request = scheduler.score_request(status, logit_capacity)
            scores = executor.score(request, layout.chunks, hidden, hidden_uncond)
            scheduler.check_scores(request, scores)
            scheduler.apply(scheduler.decide(request, status, scores))
        scheduler.end_step()

    def admit(self, slots: torch.Tensor, prompts: list[torch.Tensor], seeds: torch.Tensor,
              admissions: list[Admission]) -> None:
        """Load `prompts` into `slots`, prefill what precedes their first decode block (once per shared prefix:
        rows reusing one copy its tail page and carry), plan their first step."""
        scheduler, executor = self.scheduler, self.executor
        scheduler.admit(slots, prompts, seeds)
        computed = torch.tensor([a.slot for a in admissions if not a.reuses], dtype=torch.long, device=slots.device)
        start = torch.zeros_like(scheduler.state.first_block_start)
        start[slots] = torch.tensor([a.start for a in admissions], dtype=start.dtype, device=start.device)
        prefill = scheduler.prefill_layout(slots, executor.backend.prefill_chunk(scheduler.chunk), computed, start)
        if prefill is not None:
            layout, stored = prefill
            hidden = executor.forward(layout)[0] if layout is not None else None
            executor.commit(stored, None if layout is None else layout.chunks, hidden)
            self._share_prefixes(admissions)
            self._first_token(stored)
        loaded = torch.zeros_like(scheduler.state.done)
        loaded[slots] = True
        scheduler.prepare(loaded)

    def _share_prefixes(self, admissions: list[Admission]) -> None:
        """New shared prefixes keep their computing row's carry; rows reusing one take its tail page and carry."""
        executor = self.executor
        for admission in admissions:
            prefix = admission.prefix
            if prefix is not None and not admission.reuses and self.scheduler.cfg.logit_shift:
                prefix.carry = executor.carry[admission.slot].clone()
        for admission in admissions:
            if admission.copy is not None:
                executor.cache.copy_page(*admission.copy)
            if admission.reuses and admission.prefix.carry is not None:
                executor.carry[admission.slot] = admission.prefix.carry

    def _store(self, layout: ForwardLayout, stored: Stored | None, hidden: torch.Tensor) -> None:
        if stored is None:
            return
        self.executor.commit(stored, layout.chunks, hidden)
        self._first_token(stored)

    def _first_token(self, stored: Stored) -> None:
        """Fast-dLLM v2: the forward storing a block also decides the next block's first token."""
        if self.scheduler.policy.first_token_on_store:
            rows, position, open_ = self.scheduler.first_token_request(stored)
            token, logprob, entropy = self.executor.first_token_scores(rows, self.scheduler.context())
            self.scheduler.apply(Decision(rows, position, token, logprob, entropy, open_))
