"""The decode loop over a queue of rows, one for offline calls and the live engine (docs/architecture.md, "Serving").

Between steps it admits queued rows into free slots (their pages from the engine's `PageAssigner`), then it steps,
reports each listening row's newly committed tokens, stops rows whose committed text holds a stop string, and hands
finished rows their output, freeing their slots for the queue. A row decodes by its own prompt, seed and settings
only, so its tokens do not depend on which rows share its batch or when it joined.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from ..scheduler import geometry
from ..scheduler.settings import SlotSettings
from .stop_strings import StopStrings


@dataclass
class RowProgress:
    """What a step committed to a row: its new committed tokens (CPU lists) in order, following those reported
    before, and the decoding steps it has taken; `draft` (CPU [max_new_tokens], the mask id where undecided) when the
    row asked for drafts."""

    tokens: list[int]
    logprobs: list[float]
    steps: int
    draft: torch.Tensor | None = None


@dataclass
class RowOutput:
    """A finished row's generated positions ([its max_new_tokens], pad after its stop and where nothing was decided)
    and what RL users need about them; `length`: the tokens of its output (through its stop token or string)."""

    tokens: torch.Tensor
    commit_step: torch.Tensor
    logprobs: torch.Tensor
    entropies: torch.Tensor
    steps: int
    committed: int
    edits: int
    length: int
    stopped: bool


@dataclass(eq=False)
class Row:
    """One sequence to decode. `group`: rows of one group (samples of one prompt) share its prefix pages; `index`:
    the caller's number for it (errors name it); `report` is called after every step that commits tokens of it
    (every step it runs, with drafts), `finish` once."""

    prompt: torch.Tensor
    seed: int
    settings: SlotSettings
    group: Hashable
    index: int
    finish: Callable[[RowOutput], None]
    report: Callable[[RowProgress], None] | None = None
    drafts: bool = False
    stop_strings: StopStrings | None = None
    prefix: int = 0  # tokens before its first decode block (what a prefill computes)
    row_end: int = 0  # its canvas's end
    bound: int = 0  # the most steps it can take (reaching it is a bug: the loop raises)
    steps: int = 0
    sent: int = 0  # generated tokens reported so far
    stop_at: int | None = None  # generated tokens through the one that completed a stop string


class RowLoop:
    """The rows an engine decodes: a queue and the row in each slot."""

    def __init__(self, engine):
        self.engine, self.state = engine, engine.state
        self.queue: deque[Row] = deque()
        self.running: list[Row | None] = [None] * self.state.num_rows
        self.bound = 0  # steps all submitted rows can take one after another
        self.sampling = SlotSettings.of(engine.cfg).sampling  # the config's: rows sampling so take the fused path
        self.ahead: list[int] | None = None  # the slots of a step launched before the host reported the one before
        self.forwards = 0  # the engine's forwards when the last step this loop consumed ended
        self._host: tuple | None = None  # `_snapshot`'s host buffers (pinned on CUDA), made at its first use
        engine.start_call()

    def restart(self) -> None:
        """After a failed step: the running rows are dropped, every slot and page free (queued rows stay)."""
        self.running = [None] * self.state.num_rows
        self.ahead = None
        self.engine.start_call()

    @property
    def busy(self) -> bool:
        return bool(self.queue) or any(row is not None for row in self.running)

    def submit(self, row: Row) -> None:
        cfg = self.engine.cfg
        first, row_end, blocks = geometry(torch.tensor([len(row.prompt)]), cfg,
                                          torch.tensor([row.settings.max_new_tokens]))
        row.prefix, row.row_end, row.bound = int(first), int(row_end), row_bound(int(blocks), cfg)
        self.bound += row.bound
        self.queue.append(row)

    def cancel(self, row: Row) -> bool:
        """Take `row` out of the queue or its slot (at a step boundary); False if it is in neither."""
        if row in self.queue:
            self.queue.remove(row)
            return True
        if row not in self.running:
            return False
        slot = self.running.index(row)
        self.engine.retire(slot)
        self.engine.pages.release(slot)
        self.running[slot] = None
        return True

    def advance(self) -> tuple[list[int], list[int]]:
        """Admit queued rows into free slots, then one step, its reports and the harvest; returns the slots that
        finished and each slot's decided generated positions (for a progress bar). Where the next step can change
        nothing the host decides after this one (no row finished, none waits for a free slot, none has stop
        strings), it is launched before this step's reports: the GPU runs it while the host reports (`ahead`)."""
        slots = self._launch() if self.ahead is None else [s for s in self.ahead if self.running[s] is not None]
        self.ahead = None
        if not slots:
            return [], [0] * self.state.num_rows
        listening = [slot for slot in slots if self.running[slot].report or self.running[slot].stop_strings]
        snapshot = self._snapshot() if listening else None
        done, nonfinite, decided, draws, self.forwards = self.engine.scheduler.host_view()
        if not any(done[slot] for slot in slots) and self._nothing_to_decide(slots):
            self.engine.step()
            self.ahead = slots
        for slot in slots:
            self._count_step(slot, nonfinite[slot])
        if listening:
            self._report(listening, draws, snapshot)
        finished = [slot for slot in slots if done[slot] or self.running[slot].stop_at is not None]
        if finished:
            stops = self.engine.scheduler.output_end()
            for slot in finished:
                row, self.running[slot] = self.running[slot], None
                row.finish(self.engine.row_output(slot, stops, row))
                self.engine.pages.release(slot)
        return finished, decided

    def _launch(self) -> list[int]:
        """Admit, then launch a step of the running slots (returned; none: nothing launched)."""
        self._admit()
        slots = [slot for slot, row in enumerate(self.running) if row is not None]
        if not slots:
            if self.queue:
                raise RuntimeError("No slot can take the next queued row: its canvas needs more KV pages than the "
                                   "cache holds; raise max_cache_tokens.")
            return slots
        self.engine.scheduler.per_row_sampling = any(self.running[slot].settings.sampling != self.sampling
                                                     for slot in slots)
        self.engine.step()
        return slots

    def _nothing_to_decide(self, slots: list[int]) -> bool:
        """Whether the host can decide nothing between this step and the next: no queued row can take a free slot,
        and no row can stop on a stop string (which retires it)."""
        waiting = bool(self.queue) and len(slots) < len(self.running)
        return not waiting and not any(self.running[slot].stop_strings for slot in slots)

    def _admit(self) -> None:
        """Queued rows into free slots, in order, while the pool has their pages."""
        admissions, rows = [], []
        for slot, held in enumerate(self.running):
            if not self.queue:
                break
            if held is not None:
                continue
            row = self.queue[0]
            admission = self.engine.pages.admit(slot, row.index, row.group, row.row_end, row.prompt, row.prefix)
            if admission is None:
                break
            admissions.append(admission)
            rows.append(self.queue.popleft())
            self.running[slot] = row
        if admissions:
            self.engine.admit(admissions, rows)

    def _count_step(self, slot: int, nonfinite: int) -> None:
        row = self.running[slot]
        if nonfinite >= 0:
            raise nonfinite_error(row.index, f"at forward {nonfinite}")
        row.steps += 1
        if row.steps > row.bound:
            raise RuntimeError("generate_multi_block did not finish within the steps its blocks can take: please "
                               "report this with the config and the prompt lengths.")

    def _snapshot(self) -> tuple:
        """Every slot's canvas, log-probabilities and committed end, as numpy views of host buffers the copies fill
        behind the step (queued before `host_view`, whose read waits for them: no read of their own). Numpy, since a
        row's slice and list cost a fraction of a tensor's, and this runs at every step someone listens to."""
        state, ends = self.state, self.engine.scheduler.committed_end()
        if self._host is None:
            pinned = state.canvas.is_cuda
            self._host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=pinned)
                               for t in (state.canvas, state.logprob, ends))
        for host, device in zip(self._host, (state.canvas, state.logprob, ends)):
            host.copy_(device, non_blocking=True)
        return tuple(host.numpy() for host in self._host)

    def _report(self, slots: list[int], draws: list[int], snapshot: tuple) -> None:
        """Each listening row's newly committed tokens (and its draft), after cutting rows at their stop strings; a
        step that committed none of a row's tokens reports nothing to it (unless it asked for drafts)."""
        canvas, logprob, ends = snapshot
        for slot in slots:
            row = self.running[slot]
            start = len(row.prompt)
            ready = int(ends[slot]) - start
            if row.stop_strings is not None and ready > row.sent:
                row.stop_at = row.stop_strings.find(canvas[slot, start: start + ready].tolist(), row.sent)
                if row.stop_at is not None:
                    ready = row.stop_at
                    self.engine.retire(slot)
            if row.report is None or (ready <= row.sent and not row.drafts):  # nothing new to tell
                row.sent = max(row.sent, ready)
                continue
            draft = torch.tensor(canvas[slot, start: start + row.settings.max_new_tokens]) if row.drafts else None
            row.report(RowProgress(canvas[slot, start + row.sent: start + ready].tolist(),
                                   logprob[slot, start + row.sent: start + ready].tolist(), draws[slot], draft))
            row.sent = max(row.sent, ready)


def row_bound(blocks: int, cfg) -> int:
    """More steps than a row of `blocks` decode blocks can take: a block takes at most max(B, S) forced steps (each
    commits a token, or advances a schedule that asks for none), plus a store forward and a block-start forward, and
    with editing at most max_post_steps + 1 more (an editing block takes at most S + max_post_steps steps). Reaching
    it means a bug, never a slow decode: the loop fails instead of hanging."""
    refinement = 0 if cfg.editing_threshold is None else cfg.max_post_steps + 1
    return blocks * (max(cfg.block_size, cfg.steps_per_block) + 2 + refinement) + 3


def nonfinite_error(prompt: int, where: str) -> FloatingPointError:
    """The error that stops a call whose logits of `prompt` came out inf or nan (`where`: at which forward)."""
    return FloatingPointError(
        f"The logits of prompt {prompt} (row {prompt} of input_ids) were inf or nan {where}: the model's hidden "
        "states overflowed or hold NaN (fp16? load it in bfloat16 or float32); the call was stopped."
    )
