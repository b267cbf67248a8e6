"""One decode step, top to bottom (docs/architecture.md, "Architecture").

    status, layout = scheduler.plan()          which tokens run, where their keys are
    hidden  = executor.forward(layout)         the HF forward over the paged cache
    stored  = scheduler.stored(...)            what that forward committed ...
              executor.commit(stored, ...)     ... advances the cache (and a mode may decide from it)
    request = scheduler.score_request(...)     the undecided positions of the active blocks
    scores  = executor.score(request, ...)     LM head, guidance, processors, proposal/confidence/entropy
    scheduler.conclude(request, status, scores)  flags slots whose scores are inf/nan (the call then fails), writes
                                               the strategy's Decision (the state's one writer), finds finished
                                               slots and plans the next forward

With capacities given every shape is fixed and nothing syncs with the host, so the step can be captured as a CUDA
graph (`graphs.StepGraphs`); without, it is sized to the work and skips the forward when no slot has any. With
`compiled_bookkeeping` the scheduler's four calls run through torch.compile: inductor fuses their few hundred tiny
tensor ops into a few dozen kernels (docs/kernels.md, "Kernels and backends": compiled bookkeeping).
"""

from __future__ import annotations

import functools

import torch

from ..fusion.ahead_of_time import EAGER
from ..fusion.compiling import compile_settings
from ..scheduler import Decision, ForwardLayout, Scheduler, Stored
from ..scheduler.settings import SlotSettings
from .executor import ModelExecutor
from .pages import Admission
from .precompiled import PrecompiledPhase

PHASES = ("plan", "stored", "score_request", "conclude")  # the scheduler's calls in a step


@functools.cache
def compiled_phase(name: str):
    """`Scheduler.<name>` through torch.compile: one function per phase for every scheduler, so every engine shares
    one dynamo cache, where a configuration takes one entry (past dynamo's recompile limit of 8 a further
    configuration runs eager, with dynamo's warning and `hf-blockdiff bench`'s report). Its sizes (slots, canvas
    width, blocks) are traced as symbols, each its own (`compile_settings`: slots equal to the block size by chance
    would tie them), so an engine of another shape reuses the compiled phases instead of recompiling them. Where a
    compile cache is named, compiled ahead of time and kept there (`precompiled.py`), or eager while the compile
    worker compiles it (`fusion/compile_worker.py`)."""
    eager = getattr(Scheduler, name)
    compiled = torch.compile(eager, dynamic=True)
    ahead = PrecompiledPhase(name)

    @functools.wraps(eager)
    def phase(*args, **kwargs):
        saved = ahead.variant(*args, **kwargs)
        if saved is EAGER:
            return eager(*args, **kwargs)
        if saved is not None:
            return saved(*args, **kwargs)
        with compile_settings():
            return compiled(*args, **kwargs)

    return phase


class DecodeStep:
    def __init__(self, scheduler: Scheduler, executor: ModelExecutor, compiled_bookkeeping: bool):
        self.scheduler, self.executor = scheduler, executor
        phases = [compiled_phase(name).__get__(scheduler) if compiled_bookkeeping else getattr(scheduler, name)
                  for name in PHASES]
        self.plan, self.stored, self.score_request, self.conclude = phases

    def __call__(self, chunk_capacity: int | None = None, logit_capacity: int | None = None) -> None:
        executor = self.executor
        if chunk_capacity is None and not self.scheduler.has_work():
            self.scheduler.end_step()
            return
        status, layout = self.plan(chunk_capacity)
        hidden, hidden_uncond = executor.forward(layout)
        self._store(layout, self.stored(layout.chunks), hidden)
        request = self.score_request(status, logit_capacity)
        scores = executor.score(request, layout.chunks, hidden, hidden_uncond)
        self.conclude(request, status, scores)

    def admit(self, slots: torch.Tensor, prompts: list[torch.Tensor], seeds: torch.Tensor,
              settings: list[SlotSettings], admissions: list[Admission]) -> None:
        """Load `prompts` (with their seeds and settings) into `slots`, prefill what precedes their first decode
        block (once per shared prefix: rows reusing one copy its tail page and carry), plan their first step."""
        scheduler, executor = self.scheduler, self.executor
        scheduler.admit(slots, prompts, seeds, settings)
        computed = torch.tensor([a.slot for a in admissions if not a.reuses], dtype=torch.long, device=slots.device)
        start = torch.zeros_like(scheduler.state.first_block_start)
        start[slots] = torch.tensor([a.start for a in admissions], dtype=start.dtype, device=start.device)
        prefill = scheduler.prefill_layout(slots, executor.backend.prefill_chunk(scheduler.chunk), computed, start)
        if prefill is not None:
            layout, stored = prefill
            hidden = executor.forward(layout)[0] if layout is not None else None
            executor.commit(stored, None if layout is None else layout.chunks, hidden)
            self._share_prefixes(admissions)
            self._decide_on_store(stored)
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
        self._decide_on_store(stored)

    def _decide_on_store(self, stored: Stored) -> None:
        """Positions the mode decides from the forward that stored blocks (Fast-dLLM v2's first token of the next
        block: `WindowPolicy.store_decision`), greedily from the stored prefix's last hidden state."""
        decision = self.scheduler.store_decision(stored)
        if decision is not None:
            token, logprob, entropy = self.executor.greedy_scores(decision.rows, self.scheduler.context())
            self.scheduler.apply(Decision(decision.rows, decision.position, token, logprob, entropy, decision.open))
