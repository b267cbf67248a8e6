"""Prompt streaming: keep up to `slots` prompts decoding, refill finished slots from the queue, return results in
input order (continuous batching for block diffusion).

Each slot owns a fixed set of KV pages; a finished prompt's pages go to the next prompt of its slot. The engine
(scheduler, executor and their buffers) stays on the model between calls with the same shapes and settings, so
buffers and any captured CUDA graphs are reused; `hf_blockdiff.free_cache(model)` drops it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tqdm.auto import tqdm
from transformers.utils import logging

from ..attention import AttentionBackend
from ..config import BlockDiffusionConfig
from ..fusion.capture import experts_capture_blocker
from ..kernels.rng import fmix32
from ..weights.quantization import traceable
from ..weights.tensor_parallel import kv_head_shards
from ..scheduler import Scheduler, geometry, window_policy
from ..scheduler.settings import SlotSettings
from .executor import ModelExecutor
from ..fusion.mode import fusion_for
from .graphs import StepGraphs
from .pages import Admission, PageAssigner
from .prefix_store import PrefixStore, weights_fingerprint
from .rows import Row, RowLoop, RowOutput
from .step import DecodeStep
from .stop_strings import StopStrings

logger = logging.get_logger(__name__)


@dataclass
class Results:
    """Per prompt, in input order: generated tokens [N, max_new_tokens] (`pad_token_id` after the first stop token
    and where nothing was decided), and what RL users need about them."""

    tokens: torch.Tensor
    commit_step: torch.Tensor
    logprobs: torch.Tensor
    entropies: torch.Tensor
    num_forwards: int
    steps: torch.Tensor  # [N] decoding steps of each prompt (forwards that decided its tokens)
    committed: torch.Tensor  # [N] tokens committed for each prompt (those after its stop token included)
    edits: torch.Tensor  # [N] decided tokens replaced by editing (LLaDA2.1)

    @classmethod
    def empty(cls, prompts: int, new: int, pad: int, device: torch.device) -> "Results":
        def full(*shape, fill=0, dtype=torch.long):
            return torch.full(shape, fill, dtype=dtype, device=device)

        return cls(full(prompts, new, fill=pad), full(prompts, new, fill=-1), full(prompts, new, dtype=torch.float32),
                   full(prompts, new, dtype=torch.float32), 0, full(prompts), full(prompts), full(prompts))

    def put(self, prompt: int, output: RowOutput) -> None:
        width = len(output.tokens)
        self.tokens[prompt, :width] = output.tokens
        self.commit_step[prompt, :width] = output.commit_step
        self.logprobs[prompt, :width] = output.logprobs
        self.entropies[prompt, :width] = output.entropies
        self.steps[prompt], self.committed[prompt], self.edits[prompt] = output.steps, output.committed, output.edits


def request_seeds(count: int, generator: torch.Generator | None) -> torch.Tensor:
    """One seed per prompt, from the generator (or torch's default one): prompt i's noise depends only on it."""
    base = torch.randint(0, 2**31 - 1, (1,), generator=generator, device=getattr(generator, "device", "cpu"))
    return fmix32((base.cpu() + torch.arange(count)) & 0xFFFFFFFF)


def plan_shapes(prompt_lengths: list[int], cfg: BlockDiffusionConfig) -> tuple[int, int]:
    """(canvas width, blocks) that fit every prompt."""
    first, row_end, num_blocks = geometry(torch.tensor(prompt_lengths), cfg)
    return int(row_end.max()), int(num_blocks.max())


def shape_bucket(size: int) -> int:
    """The smallest of 2^k and 3·2^(k-1) that holds `size`: engines come in a few widths and slot counts, at most
    half again as large as a call needs, so calls of other prompt lengths and batch sizes reuse an engine (its
    compiled step and CUDA graphs) instead of building one (docs/architecture.md, "The cache")."""
    power = 1 << max(size - 1, 0).bit_length()
    return 3 * power // 4 if 3 * power // 4 >= size else power


def kv_bytes_per_token(model) -> int:
    """K and V bytes one token takes in this process's cache: its own KV heads under tensor parallelism."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) // kv_head_shards(model)
    return 2 * config.num_hidden_layers * kv_heads * head_dim * model.get_output_embeddings().weight.element_size()


def use_graphs(cfg: BlockDiffusionConfig, backend: AttentionBackend, device: torch.device, model) -> bool:
    """Fixed-shape steps (CUDA graphs on CUDA): by default on CUDA with a backend whose plans need no host sync and
    layers graphs can capture (not bitsandbytes', not experts that sync: `fusion.capture`); never with a user's
    logits processor (arbitrary Python). Forced on for experts that sync: `ValueError` before any forward."""
    if cfg.logits_processor is not None:
        return False
    blocker = experts_capture_blocker(model) if device.type == "cuda" and cfg.runtime.cuda_graphs is not False else None
    if cfg.runtime.cuda_graphs and blocker:
        raise ValueError(f"BlockDiffusionConfig.cuda_graphs=True cannot capture this model: {blocker}; or pass "
                         "cuda_graphs=None to decode without graphs.")
    if cfg.runtime.cuda_graphs is None:
        capturable = device.type == "cuda" and backend.graph_safe and traceable(model)
        if capturable and blocker:
            logger.warning_once(f"CUDA graphs are off for this model: {blocker}.")
        return capturable and blocker is None
    return cfg.runtime.cuda_graphs


class Engine:
    """A scheduler and a model executor for a fixed number of slots and canvas width, and the step joining them."""

    def __init__(self, model, cfg: BlockDiffusionConfig, slots: int, width: int, max_blocks: int,
                 backend: AttentionBackend, device: torch.device, pool_tokens: int,
                 previous: "Engine | None" = None):
        """`previous`: the model's engine before this one; its prefix store (and the cache holding it) carries over
        when the store's unit is unchanged."""
        self.cfg, self.backend = cfg, backend
        store = _kept_store(previous, cfg)
        self.scheduler = Scheduler(cfg, slots, width, max_blocks, device)
        self.state = self.scheduler.state
        graphs = use_graphs(cfg, backend, device, model)
        fusion = fusion_for(cfg, backend, graphs, device, model, slots)
        self.executor = ModelExecutor(model, cfg, backend, fusion, slots, width, device, pool_tokens,
                                      None if store is None else store.cache)
        # compiled where the layers are (the step's tiny bookkeeping kernels then fuse: docs/kernels.md, "Kernels and
        # backends"); on CUDA only, where each kernel it removes is a launch
        self.decode_step = DecodeStep(self.scheduler, self.executor, graphs and device.type == "cuda"
                                      and fusion == "compile")
        guided = cfg.guided  # the unconditional canvases mask the prompt: their prefix differs
        if store is None and cfg.runtime.prefix_cache_tokens:
            store = PrefixStore(self.executor.cache, cfg.block_size, cfg.runtime.prefix_cache_tokens)
        self.pages = PageAssigner(self.executor.cache, slots, guided, self.scheduler.policy.prefills and not guided,
                                  store, cfg.logit_shift)
        self.step = StepGraphs(self.decode_step, device.type == "cuda").step if graphs else self.decode_step

    @property
    def cache(self):
        return self.executor.cache

    def fits(self, cfg: BlockDiffusionConfig, slots: int, width: int, max_blocks: int,
             backend: AttentionBackend) -> bool:
        """Whether this engine decodes `cfg` on `slots` rows: the same config (its max_batch_size aside: the slots
        are checked apart), backend and room."""
        batch = dataclasses.replace(cfg.runtime, max_batch_size=self.cfg.runtime.max_batch_size)
        return (dataclasses.replace(cfg, runtime=batch) == self.cfg and backend.name == self.backend.name
                and self.state.fits(slots, width, max_blocks))

    def start_call(self) -> None:
        """Every slot idle and every page free (but the prefix store's): a call, or the live engine, starts."""
        self.scheduler.start_call()
        stored = self.cfg.runtime.prefix_cache_tokens
        self.pages.start_call(weights_fingerprint(self.executor.model) if stored else None)

    def generate(self, prompts: list[torch.Tensor], seeds: torch.Tensor, stream=None,
                 groups: list[int] | None = None, stop_strings: StopStrings | None = None) -> Results:
        """Decode `prompts` (the rows of one offline call, each by the config's settings); requests of one group
        (samples of one prompt) share the prompt's prefix K/V; `stream` follows row 0."""
        cfg, loop = self.cfg, RowLoop(self)
        results = Results.empty(len(prompts), cfg.max_new_tokens, cfg.pad_token_id, self.state.canvas.device)
        settings = SlotSettings.of(cfg)
        for index, prompt in enumerate(prompts):
            listens = stream is not None and index == 0
            loop.submit(Row(prompt, int(seeds[index]), settings, index if groups is None else groups[index], index,
                            functools.partial(results.put, index), stream.put_progress if listens else None,
                            listens and stream.wants_drafts, stop_strings))
        with _Progress(len(prompts), cfg.max_new_tokens) as progress:
            for _ in range(loop.bound + 1):
                if not loop.busy:
                    break
                finished, decided = loop.advance()
                progress.show(finished, decided, [-1 if row is None else row.index for row in loop.running])
        if loop.busy:
            raise RuntimeError("generate_multi_block did not finish within the steps its blocks can take: please "
                               "report this with the config and the prompt lengths.")
        if stream is not None:
            stream.end()
        results.num_forwards = self.scheduler.num_forwards
        return results

    def admit(self, admissions: list[Admission], rows: list[Row]) -> None:
        """Load `rows` into their admissions' slots (prefill included) and keep their prefixes in the store."""
        index = torch.tensor([a.slot for a in admissions], device=self.state.canvas.device)
        prompts = [row.prompt for row in rows]
        self.decode_step.admit(index, prompts, torch.tensor([row.seed for row in rows]),
                               [row.settings for row in rows], admissions)
        self.pages.remember(admissions, prompts, [row.prefix for row in rows])

    def retire(self, slot: int) -> None:
        """`slot` decodes no further (cancelled, or stopped by a stop string)."""
        self.scheduler.retire(slot)

    def row_output(self, slot: int, stops: tuple[torch.Tensor, torch.Tensor], row: Row) -> RowOutput:
        """The finished `row`'s output from `slot`: its generated positions, pad after its stop token (the first of
        `stops`), after the token completing a stop string and where nothing was decided."""
        state, cfg = self.state, self.cfg
        new = row.settings.max_new_tokens
        index = state.prompt_len[slot] + torch.arange(new, device=state.canvas.device)
        tokens = state.canvas[slot, index]
        first, has_stop = stops
        cut = index >= state.prompt_len[slot] + (new if row.stop_at is None else row.stop_at)
        dropped = (has_stop[slot] & (index > first[slot])) | (tokens == cfg.mask_token_id) | cut
        if not cfg.eos_fill:  # with the fill, what follows the stop token is the stop token already
            tokens = tokens.masked_fill(dropped, cfg.pad_token_id)
        tokens = tokens.masked_fill(cut, cfg.pad_token_id)
        commit_step = state.commit_step[slot, index].masked_fill(dropped, -1)
        kept = commit_step >= 0
        length, committed, edits = torch.stack([kept.long().cumprod(0).sum(),
                                                (state.commit_step[slot, : state.width] >= 0).sum(),
                                                state.edits[slot]]).tolist()
        return RowOutput(tokens, commit_step, state.logprob[slot, index].masked_fill(~kept, 0.0),
                         state.entropy[slot, index].masked_fill(~kept, 0.0), int(state.draws[slot]), committed,
                         edits, length, bool(has_stop[slot]) or row.stop_at is not None)


def _kept_store(previous: Engine | None, cfg: BlockDiffusionConfig) -> PrefixStore | None:
    """The previous engine's prefix store, resized, if this config stores prefixes in units of the same size."""
    store = None if previous is None else previous.pages.store
    if store is None or not cfg.runtime.prefix_cache_tokens or (
            previous.cfg.runtime.page_size, previous.cfg.block_size) != (
            cfg.runtime.page_size, cfg.block_size):
        return None
    store.resize(cfg.runtime.prefix_cache_tokens)
    return store


class _Progress:
    """A bar of tokens decided (so a long prompt shows it moves) with the prompts finished beside it."""

    def __init__(self, prompts: int, new_tokens: int):
        self.prompts, self.new_tokens, self.finished, self.harvested = prompts, new_tokens, 0, 0
        self.bar = tqdm(total=prompts * new_tokens, unit="tok", desc="generate_multi_block", delay=3, leave=False)

    def show(self, finished: list[int], decided: list[int], owner: list[int]) -> None:
        self.finished += len(finished)
        self.harvested += sum(min(decided[slot], self.new_tokens) for slot in finished)
        working = sum(min(count, self.new_tokens) for slot, count in enumerate(decided) if owner[slot] >= 0)
        self.bar.update(self.harvested + working - self.bar.n)
        self.bar.set_postfix_str(f"{self.finished}/{self.prompts} prompts", refresh=False)

    def __enter__(self) -> "_Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()


def engine_for(model, cfg: BlockDiffusionConfig, prompts: list[torch.Tensor],
               backend: AttentionBackend, device: torch.device, samples: int = 1) -> Engine:
    """The model's cached engine if it fits this call, else a new one (sized to the KV-cache budget) of the call's
    `shape_bucket`s: slots and canvas width."""
    width, max_blocks = plan_shapes([len(p) for p in prompts], cfg)
    engine = getattr(model, "_blockdiff_engine", None)
    cap = cfg.runtime.max_batch_size or math.inf  # never more rows at once than max_batch_size
    wanted = min(shape_bucket(min(len(prompts), cap)), cap)
    slots, pool_tokens = _cache_plan(model, cfg, prompts, width, wanted, samples, engine, device)
    if cfg.runtime.max_cache_tokens is None and engine is not None and slots < engine.state.num_rows <= wanted:
        slots = engine.state.num_rows  # already allocated: a budget measured now misses what its buffers hold
    slots = least_slots(slots, cfg, lambda n: fusion_for(cfg, backend, use_graphs(cfg, backend, device, model), device,
                                                         model, n))
    return kept_engine(model, lambda kept: kept.fits(cfg, slots, width, max_blocks, backend),
                       lambda: Engine(model, cfg, slots, shape_bucket(width), max_blocks, backend, device, pool_tokens,
                                      previous=engine))


def least_slots(slots: int, cfg: BlockDiffusionConfig, fusion: Callable[[int], str]) -> int:
    """`slots`, but 2 for one slot where torch.compile traces the layers and the bookkeeping (`fusion(1)`, the
    layers' fusion at one slot, is "compile"): it traces a size of 1 apart from larger ones, so a single prompt after
    batches (an eval set's last batch) would recompile them. The second slot stays idle; not where max_batch_size
    is 1."""
    if slots != 1 or cfg.runtime.max_batch_size == 1:
        return slots
    return 2 if fusion(1) == "compile" else 1


def kept_engine(model, fits: Callable[[Any], bool], build: Callable[[], Any]):
    """The engine kept on `model` (the block engine, or DiffusionGemma's canvas engine) if `fits` says it serves
    this call, else the one `build` makes, kept in its place until `free_cache` (docs/architecture.md, "The
    cache")."""
    engine = getattr(model, "_blockdiff_engine", None)
    if engine is not None and fits(engine):
        return engine
    model._blockdiff_engine = engine = None  # the old buffers go (unless `build` holds them) before new ones come
    model._blockdiff_engine = build()
    return model._blockdiff_engine


def serving_engine(model, limits) -> Engine:
    """A live engine's own engine (the model's cached one stays as it is): `limits.slots` rows of prompts up to
    `limits.max_prompt_tokens` tokens and up to the config's max_new_tokens."""
    cfg = limits.cfg
    width, max_blocks = plan_shapes(list(range(1, limits.max_prompt_tokens + 1)), cfg)
    longest = [torch.zeros(limits.max_prompt_tokens, dtype=torch.long)] * limits.slots
    slots, pool_tokens = _cache_plan(model, cfg, longest, width, limits.slots, 1, None, limits.device)
    return Engine(model, cfg, slots, width, max_blocks, limits.backend, limits.device, pool_tokens)


def _cache_plan(model, cfg: BlockDiffusionConfig, prompts: list[torch.Tensor], width: int, slots: int, samples: int,
                engine: Engine | None, device: torch.device) -> tuple[int, int]:
    """(slots, pool tokens) under the KV-cache budget (docs/architecture.md, "The cache"): every slot a canvas of `width`
    (twice with guidance), less the prefix pages the samples of a prompt share, plus a tail page per slot and the
    prefix store; the pool, sized for canvases of the width's `shape_bucket` (later calls reuse the engine), never
    exceeds the budget (prompts short of pages wait)."""
    page, guided, stored = cfg.runtime.page_size, cfg.guided, cfg.runtime.prefix_cache_tokens
    canvas, bucket = (math.ceil(w / page) * page * (2 if guided else 1) for w in (width, shape_bucket(width)))
    unbounded = slots * (bucket + page) + stored
    budget = cfg.runtime.max_cache_tokens
    if budget is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        held = 0 if engine is None else engine.cache.num_pages * page * kv_bytes_per_token(model)
        budget = int(0.8 * (free + held)) // kv_bytes_per_token(model)
    if budget is None:
        return slots, unbounded
    if canvas + stored > budget:
        beside = f" beside the {stored} of prefix_cache_tokens" if stored else ""
        raise ValueError(f"One prompt needs {canvas} KV-cache tokens{beside} but the cache holds {budget}: lower "
                         "max_new_tokens or prefix_cache_tokens, shorten the prompt or raise max_cache_tokens.")
    shared = 0
    if samples > 1 and not guided and window_policy(cfg).prefills:
        first, _, _ = geometry(torch.tensor([len(p) for p in prompts]), cfg)
        shared = int(first.min()) // page * page * (samples - 1) // samples  # per slot, on average
    slots = min(slots, max(1, (budget - stored) // (canvas + page - shared)))
    return slots, min(budget, slots * (bucket + page) + stored)
