"""DiffusionGemma's canvas denoising, model-free (docs/fidelity.md, "DiffusionGemma"): the canvas state of every
slot, the temperature schedule, the uniform-noise canvas and its renoising, entropy-bound acceptance and adaptive
stopping. The executor gives it, per step, the sampled tokens, the argmax and the entropies of every canvas
position; this class decides the next canvas. Every update is in place on fixed buffers with no host sync, so a
denoise step can be captured as a CUDA graph.

Slots move in lockstep, as transformers' `generate` moves its batch: every slot starts a canvas together, and a slot
whose canvas has stopped keeps its tokens, argmax and self-conditioning frozen while the others denoise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.canvas_scoring import canvas_statistics, gumbel_rows_argmax, processed_logits
from ..kernels.rng import uniform_tokens
from ..strategies.scoring import score_canvas
from ..strategies import entropy_bound_accept


@dataclass(frozen=True)
class CanvasRules:
    """The settings of a DiffusionGemma decode (BlockDiffusionConfig's canvas fields, resolved)."""

    length: int  # canvas_length, L
    vocab_size: int
    steps: int  # max_denoising_steps, N
    entropy_bound: float
    t_max: float
    t_min: float
    stability: int  # steps the argmax must repeat (0: stable at once)
    confidence: float  # mean entropy below which a stable canvas stops


class CanvasState:
    """Per slot: the canvas being denoised, its latest argmax, the argmax history and whether it still denoises."""

    def __init__(self, rules: CanvasRules, slots: int, device: torch.device):
        self.rules = rules
        length = rules.length
        self.canvas = torch.zeros(slots, length, dtype=torch.long, device=device)
        self.argmax = torch.zeros_like(self.canvas)
        self.history = torch.full((rules.stability, slots, length), -1, dtype=torch.long, device=device)
        self.denoising = torch.zeros(slots, dtype=torch.bool, device=device)
        self.step = torch.zeros((), dtype=torch.int32, device=device)  # steps of the current canvas so far
        self.steps = torch.zeros(slots, dtype=torch.long, device=device)  # decoding steps per slot (TPF)
        self.counting = torch.zeros(slots, dtype=torch.bool, device=device)  # slots not stopped by a stop id
        self.nonfinite = torch.zeros(slots, dtype=torch.bool, device=device)  # a step's logits held inf or nan

    def start_call(self) -> None:
        """A new call: no step counted, no logits seen inf or nan."""
        self.steps.zero_()
        self.nonfinite.zero_()

    def start(self, tokens: torch.Tensor, denoising: torch.Tensor, counting: torch.Tensor) -> None:
        """A new canvas in every slot, holding `tokens` [S, L] (uniform noise); `denoising`: slots that denoise it
        (those holding a prompt), `counting`: slots whose steps count."""
        self.canvas.copy_(tokens)
        self.argmax.copy_(tokens)
        self.history.fill_(-1)
        self.denoising.copy_(denoising)
        self.step.zero_()
        self.counting.copy_(counting)

    def temperature(self) -> torch.Tensor:
        """The schedule's temperature at this step (a 0-dim float32 tensor): transformers' linear schedule
        t = t_min + (t_max − t_min) · n / N over the steps remaining n = N … 1, with its float32 arithmetic."""
        rules = self.rules
        remaining = rules.steps - self.step
        return rules.t_min + ((rules.t_max - rules.t_min) * (remaining / rules.steps))

    def update(self, sampled: torch.Tensor, argmax: torch.Tensor, entropy: torch.Tensor,
               fresh: torch.Tensor) -> torch.Tensor:
        """One denoising step from the step's samples, argmax and entropies [S, L] and `fresh` uniform tokens:
        accepted positions take their sample, the others the fresh noise; a slot stops once its argmax repeated
        for `stability` steps and its mean entropy is below `confidence`. Returns the slots that were denoising
        (their self-conditioning moves on)."""
        rules, live = self.rules, self.denoising.clone()
        self.steps.add_((live & self.counting).long())
        self.nonfinite.logical_or_(live & self.counting & ~torch.isfinite(entropy).all(-1))  # tokens that count
        accepted = entropy_bound_accept(entropy, rules.entropy_bound)
        renoised = torch.where(accepted, sampled, fresh)
        self.canvas.copy_(torch.where(live[:, None], renoised, self.canvas))
        self.argmax.copy_(torch.where(live[:, None], argmax, self.argmax))
        stable = (self.history == self.argmax[None]).all(-1).all(0)
        if rules.stability:
            self.history.copy_(torch.roll(self.history, shifts=-1, dims=0))
            self.history[-1] = self.argmax
        confident = entropy.mean(-1) < rules.confidence
        self.denoising.copy_(live & ~(stable & confident))
        self.step.add_(1)
        return live

    def finished(self) -> torch.Tensor:
        """0-dim bool: no slot denoises any more, or the canvas has had its N steps."""
        return ~self.denoising.any() | (self.step >= self.rules.steps)

    def status(self) -> tuple[bool, int | None]:
        """In one host read: whether the canvas is finished, and the first slot whose logits were inf or nan (None:
        none; its tokens are not to be trusted, and the caller stops: an all-NaN row samples token 0)."""
        finished, any_bad, bad = torch.stack([self.finished().long(), self.nonfinite.any().long(),
                                              self.nonfinite.long().argmax()]).tolist()
        return bool(finished), bad if any_bad else None


class CounterNoise:
    """The fast path's noise: counter-based hashes of (prompt seed, canvas, step, position[, token]), so a prompt
    samples the same alone and in any batch (docs/architecture.md, "Scoring and strategies"). Counters: position p of
    canvas c at step t (t = 0: the initial canvas) is (c·(N + 1) + t)·L + p, mod 2**32."""

    def __init__(self, rules: CanvasRules, seeds: torch.Tensor):
        self.rules, self.seeds = rules, seeds
        self.positions = torch.arange(rules.length, device=seeds.device)

    def counters(self, canvas: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """[S, L] counters of the given canvas index [S] and step (0-dim)."""
        rules = self.rules
        return ((canvas[:, None] * (rules.steps + 1) + step) * rules.length + self.positions) & 0xFFFFFFFF

    def tokens(self, canvas: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """Uniform tokens [S, L]: the initial canvas (step 0) and the renoising after step t."""
        counters = self.counters(canvas, step)
        return uniform_tokens(self.seeds[:, None].expand_as(counters), counters, self.rules.vocab_size)

    def rows(self, canvas: torch.Tensor, step: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The seed and counter [S·L] of every canvas position's sampling noise."""
        return self.seeds.repeat_interleave(self.rules.length), self.counters(canvas, step).reshape(-1)

    def sample(self, processed: torch.Tensor, canvas: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """A token per row of `processed` [S·L, V] from softmax(processed): Gumbel-max with this step's noise."""
        return gumbel_rows_argmax(processed, *self.rows(canvas, step))

    def score(self, logits: torch.Tensor, softcap: float | None, temperature: torch.Tensor, probs_dtype: torch.dtype,
              canvas: torch.Tensor, step: torch.Tensor):
        """(sample, argmax, entropy, logprob, probs) of the step's raw logits [S·L, V] (`scoring.score_canvas`:
        fused on CUDA)."""
        return score_canvas(logits, softcap, temperature, *self.rows(canvas, step), probs_dtype)


class TorchOrderNoise:
    """Compatibility noise (`noise="torch"`): torch's generator drawn in the order transformers' `generate` draws
    it (per canvas `randint` [S, L]; per step `multinomial` over every slot's softmax, then `randint` [S, L]), so
    a seeded run gives its tokens. The draws depend on the whole batch and sync with the host: tests only. Only the
    first `prompts` of the `slots` rows draw (the batch transformers sees); the rest take token 0."""

    def __init__(self, rules: CanvasRules, prompts: int, slots: int, generator: torch.Generator | None,
                 device: torch.device):
        self.rules, self.prompts, self.slots, self.generator, self.device = rules, prompts, slots, generator, device

    def tokens(self, canvas: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        shape = (self.prompts, self.rules.length)
        drawn = torch.randint(0, self.rules.vocab_size, shape, generator=self.generator, device=self.device)
        return torch.cat([drawn, drawn.new_zeros(self.slots - self.prompts, self.rules.length)])

    def sample(self, processed: torch.Tensor, canvas: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(processed[: self.prompts * self.rules.length], dim=-1, dtype=torch.float32)
        drawn = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(-1)
        return torch.cat([drawn, drawn.new_zeros(len(processed) - len(drawn))])

    def score(self, logits: torch.Tensor, softcap: float | None, temperature: torch.Tensor, probs_dtype: torch.dtype,
              canvas: torch.Tensor, step: torch.Tensor):
        """CounterNoise.score's values in transformers' torch operations and draw order."""
        processed = processed_logits(logits, softcap, temperature)
        return self.sample(processed, canvas, step), *canvas_statistics(processed, probs_dtype)
