"""DiffusionGemma on the paged cache (docs/fidelity.md, "DiffusionGemma"): an encoder writes the prompt and every
finished canvas into `PagedBlockCache`; a decoder with its own weights denoises a canvas of `canvas_length` tokens
bidirectionally over that prefix, read-only (its canvas K/V are written ahead of the committed pointer, as every
window here). The canvas rules (noise, acceptance, stopping, temperature) are `canvas.schedule`'s; the model's
pieces come from `canvas.diffusion_gemma` as a `CanvasModel`.

A denoise step has fixed shapes [slots, canvas_length] and no host sync, so with the `triton` backend on CUDA it is
captured once as a CUDA graph and replayed; the host reads two flags per step (has every canvas stopped; did a
slot's logits come out inf or nan, which stops the call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

from ..attention import AttentionBackend
from ..cache import PagedBlockCache
from .schedule import CanvasRules, CanvasState, CounterNoise, TorchOrderNoise
from ..generation.engine import Results
from ..generation.rows import nonfinite_error
from ..generation.graphs import capturing, compile_ahead


class CanvasModel(Protocol):
    """What the canvas engine needs of a model (canvas.diffusion_gemma.DiffusionGemmaRunner)."""

    num_layers: int
    hidden_size: int
    sliding_window: int | None

    def encode(self, tokens: torch.Tensor, positions: torch.Tensor, **attention) -> None: ...

    def denoise(self, tokens: torch.Tensor, positions: torch.Tensor, conditioning: torch.Tensor,
                **attention) -> torch.Tensor: ...

    softcap: float | None
    dtype: torch.dtype  # the model's: the self-conditioning probabilities are cast to it

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def conditioning(self, probs: torch.Tensor) -> torch.Tensor: ...

    def decoding(self, fusion: str): ...


@dataclass(frozen=True)
class CanvasRun:
    """How an engine runs, fixed for its life: a call with other settings gets another engine."""

    noise: str  # "counter" | "torch"
    graphs: bool
    fusion: str
    page_size: int


@dataclass(frozen=True)
class CanvasCall:
    """What one call asks beside its prompts."""

    max_new_tokens: int
    stop_ids: tuple[int, ...]
    pad_token_id: int | None
    seeds: torch.Tensor | None  # one per prompt (counter noise)
    generator: torch.Generator | None  # drawn by the torch noise


def canvas_width(prompts: list[torch.Tensor], max_new_tokens: int, length: int) -> int:
    """The cache row the longest prompt needs: its tokens and whole canvases covering `max_new_tokens`."""
    return max(len(p) for p in prompts) + math.ceil(max_new_tokens / length) * length


class CanvasEngine:
    """The buffers, cache and captured step of `slots` rows of up to `width` cache tokens, kept on the model between
    calls that fit them (docs/architecture.md, "The cache"). A call's prompts take the first rows; the rows after
    them never denoise, and rows are independent, so the tokens do not depend on the engine's size."""

    def __init__(self, runner: CanvasModel, rules: CanvasRules, run: CanvasRun, backend: AttentionBackend,
                 slots: int, width: int, device: torch.device):
        self.runner, self.rules, self.run, self.backend, self.width = runner, rules, run, backend, width
        self.key = (rules, run, backend.name, device, runner.dtype)
        length = rules.length
        self.cache = PagedBlockCache(runner.num_layers, run.page_size)
        self.cache.start(slots, width, slots * self.cache.pages_for(width) * run.page_size, device)
        self.state = CanvasState(rules, slots, device)
        self.seeds = torch.zeros(slots, dtype=torch.long, device=device)  # the call's, rows after its prompts 0
        self.counter_noise = CounterNoise(rules, self.seeds)  # one object: a captured step reads its buffers
        self.noise: CounterNoise | TorchOrderNoise = self.counter_noise
        self.conditioning = torch.zeros(slots, length, runner.hidden_size, dtype=runner.dtype, device=device)
        self.logprob = torch.zeros(slots, length, device=device)
        self.entropy = torch.zeros(slots, length, device=device)
        self.canvas_index = torch.zeros(slots, dtype=torch.long, device=device)
        self.offsets = torch.arange(length, device=device)
        self.rows = torch.arange(slots, device=device)
        self.graph, self.forwards = None, 0

    def fits(self, rules: CanvasRules, run: CanvasRun, backend: AttentionBackend, slots: int, width: int,
             device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this engine decodes a call of these settings on `slots` rows of `width` tokens."""
        return (rules, run, backend.name, device, dtype) == self.key and slots == len(self.rows) \
            and width <= self.width

    def start_call(self, prompts: list[torch.Tensor], call: CanvasCall) -> int:
        """Pages for the prompts' rows, their seeds or generator, counters from zero; returns the call's canvases."""
        length, count = self.rules.length, len(prompts)
        canvases = math.ceil(call.max_new_tokens / length)
        self.cache.reset_pages()
        self.cache.reset()
        for row, prompt in enumerate(prompts):
            self.cache.assign(row, self.cache.pages.take(self.cache.pages_for(len(prompt) + canvases * length)))
        if self.run.noise == "counter":
            self.seeds.zero_()[:count] = call.seeds
            self.noise = self.counter_noise
        else:
            self.noise = TorchOrderNoise(self.rules, count, len(self.rows), call.generator, self.rows.device)
        self.state.start_call()
        self.forwards = 0
        return canvases

    def plan(self, positions: torch.Tensor, valid: torch.Tensor, limits: torch.Tensor, starts: torch.Tensor):
        """The attention plan of a forward over every slot: keys [starts, limits) in sliding-window layers, [0,
        limits) in the others (docs/fidelity.md, "DiffusionGemma")."""
        plan = self.backend.plan(self.cache, self.rows, positions, valid, limits.int())
        if self.runner.sliding_window is not None:
            plan.q_start = starts.clamp(min=0).int()
        return plan

    def encode(self, tokens: torch.Tensor, valid: torch.Tensor) -> None:
        """The encoder over `tokens` [S, W] placed after each slot's committed tokens (causal; a sliding layer sees
        the last `sliding_window` keys up to the query); their K/V are committed."""
        positions = self.cache.committed[:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        window = self.runner.sliding_window or 1
        plan = self.plan(positions, valid, torch.where(valid, positions + 1, 0), positions - window + 1)
        self.runner.encode(tokens, positions, blockdiff_cache=self.cache, blockdiff_plan=plan)
        self.cache.commit(self.rows, valid.sum(1))
        self.forwards += 1

    def denoise_step(self) -> None:
        """One fixed-shape denoising step of every slot's canvas (frozen canvases are computed and left as they
        were, as transformers' batch does)."""
        rules, state, runner = self.rules, self.state, self.runner
        slots, length = state.canvas.shape
        base = self.cache.committed[:, None]
        positions = base + self.offsets
        first = base - (runner.sliding_window or 1) + 1  # the decoder's sliding layers: the last W − 1 prefix keys
        plan = self.plan(positions, torch.ones_like(positions, dtype=torch.bool),
                         (base + length).expand_as(positions), first.expand_as(positions))
        hidden = runner.denoise(state.canvas, positions, self.conditioning, blockdiff_cache=self.cache,
                                blockdiff_plan=plan)
        step = state.step + 1
        sampled, argmax, entropy, logprob, probs = self.noise.score(
            runner.logits(hidden.reshape(slots * length, -1)), runner.softcap, state.temperature(), runner.dtype,
            self.canvas_index, step)
        live = state.update(sampled.view(slots, length), argmax.view(slots, length), entropy.view(slots, length),
                            self.noise.tokens(self.canvas_index, step))
        keep = live[:, None]
        self.entropy.copy_(torch.where(keep, entropy.view(slots, length), self.entropy))
        self.logprob.copy_(torch.where(keep, logprob.view(slots, length), self.logprob))
        conditioning = runner.conditioning(probs).view(self.conditioning.shape)
        self.conditioning.copy_(torch.where(keep[..., None], conditioning, self.conditioning))

    def step(self) -> None:
        """A denoise step: replayed from its CUDA graph when graphs are on (captured after the engine's first step;
        kept for later calls)."""
        if self.graph is not None:
            self.graph.replay()
        else:
            graphed = self.run.graphs and self.state.canvas.is_cuda
            # compiled layers compile at the first step here: running them as written inside the thrown-away
            # capture (the decode step's way, generation/graphs.py) has not run on a GPU for the canvas
            if graphed and self.run.fusion != "compile":
                compile_ahead(self.denoise_step, self.state.canvas.device, self.cache)
            self.denoise_step()
            if graphed:
                graph = torch.cuda.CUDAGraph()
                with capturing(graph):
                    self.denoise_step()
                self.graph = graph  # only once captured whole: a failed capture is not replayed by a later call
        self.forwards += 1

    def generate(self, prompts: list[torch.Tensor], call: CanvasCall, stream=None) -> Results:
        """Canvas after canvas until every prompt holds a stop id or `max_new_tokens` are covered."""
        state, device = self.state, self.rows.device
        canvases = self.start_call(prompts, call)
        active = self.rows < len(prompts)  # rows holding a prompt of this call
        tokens = torch.zeros(len(self.rows), max(len(p) for p in prompts), dtype=torch.long, device=device)
        tokens[: len(prompts)] = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True)
        lengths = torch.zeros_like(self.rows)
        lengths[: len(prompts)] = torch.tensor([len(p) for p in prompts], device=device)
        valid = torch.arange(tokens.shape[1], device=device) < lengths[:, None]
        stopped = ~active
        stop_ids = torch.tensor(call.stop_ids, dtype=torch.long, device=device)
        generated, steps_at = [], []
        with self.runner.decoding(self.run.fusion):
            for canvas in range(canvases):
                self.encode(tokens, valid)
                self.canvas_index.fill_(canvas)
                state.start(self.noise.tokens(self.canvas_index, torch.zeros((), dtype=torch.long, device=device)),
                            active, ~stopped)
                self.conditioning.zero_()
                self.denoise(canvas, stream)
                tokens, valid = state.argmax.clone(), active[:, None].expand_as(state.argmax)
                generated.append((tokens, self.logprob.clone(), self.entropy.clone()))
                steps_at.append(self.forwards)
                stopped |= torch.isin(tokens, stop_ids).any(1)
                if stream is not None:
                    stream.canvas(tokens[0])
                if bool(stopped.all()):
                    break
        return self.results(generated, steps_at, stop_ids, call, len(prompts))

    def denoise(self, canvas: int, stream) -> None:
        """Steps until the canvas is finished; logits that came out inf or nan stop the call."""
        state = self.state
        while True:
            self.step()
            finished, bad = state.status()
            if bad is not None:
                raise nonfinite_error(bad, f"at denoising step {int(state.step)} of canvas {canvas}")
            if stream is not None:
                stream.draft(state.argmax[0])
            if finished:
                return

    def results(self, generated: list, steps_at: list[int], stop_ids: torch.Tensor, call: CanvasCall,
                count: int) -> Results:
        """The first `count` rows' tokens up to each prompt's first stop id, `pad_token_id` after it (none without a
        pad id, as transformers), cut to `max_new_tokens`; commit steps are the forward that ended the token's
        canvas."""
        length, new = self.rules.length, call.max_new_tokens
        tokens, logprobs, entropies = (torch.cat([g[i][:count] for g in generated], 1)[:, :new] for i in range(3))
        commit = torch.tensor([s for s in steps_at for _ in range(length)], device=tokens.device)
        commit = commit[: tokens.shape[1]].expand_as(tokens).clone()
        dropped = torch.zeros_like(tokens, dtype=torch.bool)
        if call.pad_token_id is not None:
            is_stop = torch.isin(tokens, stop_ids)
            dropped = (is_stop.cumsum(1) - is_stop.long()) > 0
            tokens = tokens.masked_fill(dropped, call.pad_token_id)
        if tokens.shape[1] < new:  # every prompt stopped before the last canvas
            fill = new - tokens.shape[1]
            tokens = torch.nn.functional.pad(tokens, (0, fill), value=call.pad_token_id or 0)
            dropped = torch.nn.functional.pad(dropped, (0, fill), value=True)
            logprobs, entropies, commit = (torch.nn.functional.pad(t, (0, fill)) for t in (logprobs, entropies, commit))
        steps = self.state.steps[:count].clone()
        return Results(tokens=tokens, commit_step=commit.masked_fill(dropped, -1),
                       logprobs=logprobs.masked_fill(dropped, 0.0), entropies=entropies.masked_fill(dropped, 0.0),
                       num_forwards=self.forwards, steps=steps, committed=(~dropped).sum(1),
                       edits=torch.zeros_like(steps))


class CanvasStream:
    """Feeds a transformers streamer (batch 1): `put` the prompt, then each finished canvas up to the first stop id;
    `put_draft(tokens, decided)` (if the streamer has it) the current argmax canvas after every step, none of it
    decided yet."""

    def __init__(self, streamer, input_ids: torch.Tensor, stop_ids: tuple[int, ...]):
        if input_ids.shape[0] != 1:
            raise ValueError("streamer needs a batch of one prompt.")
        self.streamer, self.stop_ids, self.stopped = streamer, stop_ids, False
        self.put_draft = getattr(streamer, "put_draft", None)
        streamer.put(input_ids[0].cpu())

    def draft(self, argmax: torch.Tensor) -> None:
        if self.put_draft is not None and not self.stopped:
            tokens = argmax.to("cpu", copy=True)
            self.put_draft(tokens, torch.zeros_like(tokens, dtype=torch.bool))

    def canvas(self, tokens: torch.Tensor) -> None:
        if self.stopped:
            return
        tokens = tokens.cpu()
        stops = torch.isin(tokens, torch.tensor(self.stop_ids, dtype=torch.long))
        if bool(stops.any()):
            tokens, self.stopped = tokens[: int(stops.int().argmax()) + 1], True
        self.streamer.put(tokens)

    def end(self) -> None:
        self.streamer.end()
