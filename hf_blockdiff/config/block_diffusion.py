"""`BlockDiffusionConfig`: every knob of the decode loop, validated on construction (docs/architecture.md, "The decode
loop", "Scoring and strategies", "Errors")."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .checks import (
    check_against_profile, check_canvas_fields, check_editing_fields, check_ids, check_minimal_topk, check_modes,
    decoded_block_size, fail, is_int, is_number,
)
from .record import explicit_fields, record_passed_fields
from .runtime import (
    RUNTIME_FIELDS, RuntimeOptions, moved_to_runtime, route_runtime_keywords, with_runtime,
)
from .presets import PRESETS, preset_fields
from .profiles import ALIGNMENTS, ATTENTIONS, ModelProfile
from ..strategies import STRATEGIES, strategy_names

FALLBACKS = ("topk", "leftmost")
CONFIDENCE_SOURCES = ("filtered", "unfiltered", "raw")
APPROX_CACHES = ("none", "prefix", "dual")
SCORE_PRECISIONS = ("float32", "float64")
FORCED_TOKEN_SCOPES = ("lowest_full_block", "all_active")

# fields a model profile may fill in when the user leaves them unset
PROFILE_FIELDS = ("mask_token_id", "block_size", "attention", "alignment", "logit_shift", "eos_token_id", "pad_token_id")


@dataclass
class BlockDiffusionConfig:
    """How `generate_multi_block` decodes. Fields left as `None` come from the model's profile (docs/fidelity.md,
    "Model families"). Precedence: call keywords > `explicit_fields` > preset > model's `generation_config` > defaults
    and profile. How the call runs on its device (backend, CUDA graphs, compile, pages, prefix cache, batch) is
    `runtime`, a `RuntimeOptions`; its fields are keywords here too.

    Blocks and schedule:
        mask_token_id: id written at undecided positions; never proposed.
        block_size: positions decoded together (B); unset: the size the checkpoint was trained with, else the
            preset's, else the profile's (docs/fidelity.md, "Presets").
        steps_per_block: S of the schedule n_t = ⌊B/S⌋ + [t < B mod S].
        minimal_topk: k of diffusers' LLaDA2Pipeline: S is capped at max_new_tokens // k (fewer steps, so each
            commits more; None: no cap; 1: no more steps than new tokens).
        max_active_blocks: K blocks decoded at once (1 = single-block); block_add_threshold: progress of the last
            block at which the next one is added; decoded_token_threshold: progress of a block's predecessor at which
            it becomes fully activated (forced to make progress); add_activation_threshold: predecessor progress at
            which a newly added block is fully activated at once (None: decoded_token_threshold).
        alignment: "absolute" (blocks at multiples of B, prompt tail in the first block) or "prompt_end".
        attention: "block_causal" (exact KV cache) or "bidirectional" (full recompute).
        prompt_attention: how the prompt positions before the first decode block see each other under block-causal
            attention with absolute blocks: "block_causal" (a staircase of blocks, as SDAR trains) or "bidirectional"
            (one block, as JetEngine prefills LLaDA-architecture checkpoints); None: block_causal there,
            bidirectional elsewhere (prompt_end blocks and bidirectional models always see the prompt as one block).
        logit_shift: token i is predicted at position i-1.

    Which positions a step commits (docs/architecture.md, "Scoring and strategies"):
        strategy / threshold / fallback: the remasking strategy, its threshold and what a block forced to make
            progress commits when nothing passes; threshold_strict: compare c > τ instead of ≥ (None: the
            strategy's own rule). Strategy parameters: entropy_budget (γ, entropy_bounded), relative_alpha (α,
            relative_top), factor (confidence_factor), dream_eps (ε of Dream's schedule).
        forced_token_scope: where the forced token of rules that force one only when none passes (entropy_threshold
            and the like) may lie: "lowest_full_block" (the lowest fully activated active block; d3LLM's Dream
            decoder) or "all_active" (besides that, the best candidate of all the slot's active blocks when none
            passes in any of them; d3LLM's LLaDA decoder).

    Sampling and scores:
        temperature / top_k / top_p: proposal sampling; temperature 0 is greedy, top_k ≤ 0 and top_p = 1 are off.
            top_p outside (0, 1] is refused: above 1 as transformers' TopPLogitsWarper refuses it (rather than read as
            off), 0 as a nucleus of no probability (top_k=1 keeps the most likely token).
        repetition_penalty: transformers semantics, over the row's decided tokens. pos_temp_slope: T_i = T·(1 +
            slope·i/(B−1)) for position i of a block. cfg_scale: LLaDA classifier-free guidance (bidirectional
            models). logits_processor: a transformers LogitsProcessorList applied to the flattened block logits (its
            input_ids are the rows' canvases).
        confidence: "filtered" (probability under the distribution the token was drawn from), "unfiltered"
            (softmax(ℓ/T) before top-k/top-p, as JetEngine) or "raw" (softmax(ℓ), as LLaDA); score_precision: the
            softmax dtype of confidence and entropy.

    Stopping and limits:
        eos_token_id / pad_token_id / early_stop: stop ids, the id written after the first stop token, and whether a
            row ends once the block holding its first stop token is complete (then `pad_token_id` follows the stop
            token); early_stop=False decodes every row to max_new_tokens and replaces nothing.
        eos_fill: the first stop token fills every later position (d3LLM).
        max_new_tokens: new tokens per prompt. max_forwards / max_repeat_run: request limits (Diffulex): a prompt
            ends once it took `max_forwards` decoding steps (its `steps` output; prefill and store forwards do not
            count), or once its generated tokens, decided from the first on, hold a run of `max_repeat_run` equal
            tokens (the output ends with that run); the positions after are the pad id. None: no limit.

    Editing (LLaDA2.1, Diffulex; docs/architecture.md, "The decode loop"):
        editing_threshold / max_post_steps: a decided, non-prompt position of the active block (block-causal, one
            active block) takes the model's proposal where it differs with confidence > editing_threshold (None:
            off), and a block whose masks were filled before its S-th step keeps refining while its steps edit
            something, at most max_post_steps + 1 steps; the last one commits every mask left.
        remask_threshold / stability_threshold / edit_penalty (preset `diffulex_edit`): a decided generated position
            of the active block whose proposal has confidence < remask_threshold turns back into a mask (None: off);
            a refinement step ends the refining when it left at least stability_threshold of the block's decided
            tokens unchanged (1: only a step that changes nothing); edit_penalty is subtracted from the logit of the
            token just before a position in its block (0: off).

    Reference behaviours (set by presets; docs/fidelity.md, "Presets"):
        preset: the preset the config came from (the model facts it pins are checked against the profile).
        fused_store: store a finished block's K/V in the next block's first forward (token-identical, fewer
            forwards). sub_block_size: Fast-dLLM v2 decodes a block sub-block by sub-block; first_token_on_store: the
            forward that stores a block commits the next block's first token greedily (Fast-dLLM v2). approx_cache:
            "prefix"/"dual", Fast-dLLM v1's approximate caches for bidirectional models.

    DiffusionGemma's canvas denoising (docs/fidelity.md, "DiffusionGemma"; None: the checkpoint's generation config,
    else transformers' defaults):
        max_denoising_steps, entropy_bound, t_max → t_min (the temperature schedule), stop_stability /
            stop_confidence (adaptive stopping: transformers' stability_threshold / confidence_threshold).
        noise: "counter" (the fast path's hashes) or "torch" (torch's generator in transformers' order, for tests).

    Runtime:
        runtime: a `RuntimeOptions` (attention_backend, cuda_graphs, compile, page_size, max_cache_tokens,
            prefix_cache_tokens, max_batch_size); none of them changes what is decoded.
    """

    mask_token_id: int | None = None
    block_size: int | None = None
    steps_per_block: int | None = None
    minimal_topk: int | None = None
    max_new_tokens: int = 128
    strategy: str = "low_confidence_dynamic"
    threshold: float | None = None
    fallback: str = "topk"
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_active_blocks: int = 1
    block_add_threshold: float = 1.0
    decoded_token_threshold: float = 1.0
    alignment: str | None = None
    attention: str | None = None
    prompt_attention: str | None = None
    logit_shift: bool | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    early_stop: bool = True
    fused_store: bool = True
    repetition_penalty: float = 1.0
    pos_temp_slope: float = 0.0
    confidence: str = "filtered"
    cfg_scale: float = 0.0
    logits_processor: Any = None
    entropy_budget: float = 1.0
    relative_alpha: float = 0.9
    factor: float = 1.0
    threshold_strict: bool | None = None
    sub_block_size: int | None = None
    first_token_on_store: bool = False
    approx_cache: str = "none"
    eos_fill: bool = False
    add_activation_threshold: float | None = None
    score_precision: str = "float32"
    dream_eps: float = 1e-3
    preset: str | None = None
    forced_token_scope: str = "lowest_full_block"
    editing_threshold: float | None = None
    max_post_steps: int = 16
    remask_threshold: float | None = None
    stability_threshold: float = 1.0
    edit_penalty: float = 0.0
    max_forwards: int | None = None
    max_repeat_run: int | None = None
    max_denoising_steps: int | None = None
    entropy_bound: float | None = None
    t_max: float | None = None
    t_min: float | None = None
    stop_stability: int | None = None
    stop_confidence: float | None = None
    noise: str = "counter"
    runtime: RuntimeOptions = dataclasses.field(default_factory=RuntimeOptions)

    def __post_init__(self) -> None:
        self._validate()

    def __getattr__(self, name: str):
        if name in RUNTIME_FIELDS:
            raise AttributeError(moved_to_runtime(name))
        raise AttributeError(f"'BlockDiffusionConfig' object has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        if name in RUNTIME_FIELDS:
            raise AttributeError(moved_to_runtime(name))
        object.__setattr__(self, name, value)

    def _validate(self) -> None:
        for field in dataclasses.fields(self):  # inf/nan settings would make no step commit anything
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                fail(field.name, value, "pass a finite number")
        for name in ("block_size", "steps_per_block", "max_new_tokens", "max_active_blocks"):
            value = getattr(self, name)
            if (value is not None or name == "max_new_tokens") and (not is_int(value) or value <= 0):
                fail(name, value, "pass a positive integer")
        for name, low in (("max_forwards", 1), ("max_repeat_run", 2)):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < low):
                fail(name, value, f"pass an integer ≥ {low}, or None for no limit")
        if self.max_repeat_run is not None and self.eos_fill:
            fail("max_repeat_run", self.max_repeat_run, "a repeated run is cut with the pad id, which eos_fill "
                  "replaces with stop ids: pass one of max_repeat_run and eos_fill")
        if self.mask_token_id is not None and (not isinstance(self.mask_token_id, int) or self.mask_token_id < 0):
            fail("mask_token_id", self.mask_token_id, "pass the non-negative id of the mask token")
        if self.strategy not in STRATEGIES:
            fail("strategy", self.strategy, f"choose one of {', '.join(strategy_names())}")
        if self.threshold is not None:
            low, high = STRATEGIES[self.strategy].threshold_range
            if not (isinstance(self.threshold, (int, float)) and low <= self.threshold <= high):
                fail("threshold", self.threshold, f"strategy {self.strategy!r} needs a threshold in [{low}, {high}]")
        if self.fallback not in FALLBACKS:
            fail("fallback", self.fallback, f"choose one of {', '.join(FALLBACKS)}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            fail("temperature", self.temperature, "pass 0 for greedy decoding or a positive float to sample")
        if not isinstance(self.top_k, int):
            fail("top_k", self.top_k, "pass an integer (≤ 0 disables top-k)")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            fail("top_p", self.top_p, "pass a float in (0, 1] (1 disables top-p)")
        check_minimal_topk(self)
        check_canvas_fields(self)
        self._validate_modes()

    def _validate_modes(self) -> None:
        for name in ("block_add_threshold", "decoded_token_threshold"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                fail(name, value, "pass a block progress fraction in [0, 1]")
        if self.alignment is not None and self.alignment not in ALIGNMENTS:
            fail("alignment", self.alignment, f"choose one of {', '.join(ALIGNMENTS)}")
        for name in ("attention", "prompt_attention"):
            if getattr(self, name) is not None and getattr(self, name) not in ATTENTIONS:
                fail(name, getattr(self, name), f"choose one of {', '.join(ATTENTIONS)}")
        for name, allowed in (("confidence", CONFIDENCE_SOURCES), ("approx_cache", APPROX_CACHES),
                              ("score_precision", SCORE_PRECISIONS), ("forced_token_scope", FORCED_TOKEN_SCOPES)):
            if getattr(self, name) not in allowed:
                fail(name, getattr(self, name), f"choose one of {', '.join(allowed)}")
        if self.forced_token_scope != "lowest_full_block" and not STRATEGIES[self.strategy].forced_top1:
            fail("forced_token_scope", self.forced_token_scope, f"strategy {self.strategy!r} has no forced token "
                  "taken when none passes; choose 'lowest_full_block' or a strategy such as entropy_threshold")
        for name, low in (("repetition_penalty", 0.0), ("entropy_budget", 0.0), ("factor", 0.0), ("dream_eps", 0.0)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= low:
                fail(name, value, f"pass a number > {low}")
        if not isinstance(self.relative_alpha, (int, float)) or not 0.0 < self.relative_alpha <= 1.0:
            fail("relative_alpha", self.relative_alpha, "pass α in (0, 1]")
        if not isinstance(self.cfg_scale, (int, float)) or self.cfg_scale < 0:
            fail("cfg_scale", self.cfg_scale, "pass 0 (off) or a positive guidance scale")
        if self.add_activation_threshold is not None and not 0.0 <= self.add_activation_threshold <= 1.0:
            fail("add_activation_threshold", self.add_activation_threshold, "pass a progress fraction in [0, 1]")
        if self.sub_block_size is not None and (
            not isinstance(self.sub_block_size, int) or self.sub_block_size <= 0
            or (self.block_size is not None and self.block_size % self.sub_block_size)
        ):
            fail("sub_block_size", self.sub_block_size, "pass a positive divisor of block_size")
        if self.sub_block_size is not None and (self.fused_store or self.attention == "bidirectional"):
            fail("sub_block_size", self.sub_block_size, "sub-blocks are Fast-dLLM v2's decoding: they need "
                  "attention='block_causal' and fused_store=False (or use the fast_dllm_v2 preset)")
        self._validate_switches()
        check_editing_fields(self)

    def _validate_switches(self) -> None:
        if not isinstance(self.runtime, RuntimeOptions):
            fail("runtime", self.runtime, "pass a RuntimeOptions (or its fields as keywords)")
        for name in ("early_stop", "fused_store", "first_token_on_store", "eos_fill"):
            if not isinstance(getattr(self, name), bool):
                fail(name, getattr(self, name), "pass True or False")
        if self.logits_processor is not None and not callable(self.logits_processor):
            fail("logits_processor", self.logits_processor, "pass a transformers LogitsProcessorList")
        eos = self.eos_token_id
        if eos is not None and not (
            (isinstance(eos, int) and eos >= 0)
            or (isinstance(eos, (list, tuple)) and all(isinstance(e, int) and e >= 0 for e in eos))
        ):
            fail("eos_token_id", eos, "pass a token id or a list of token ids")

    @property
    def stop_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

    @property
    def stopping_ids(self) -> tuple[int, ...]:
        """The ids that end a row: the stop ids with `early_stop`, none without."""
        return self.stop_ids if self.early_stop else ()

    @property
    def effective_threshold(self) -> float:
        return STRATEGIES[self.strategy].default_threshold if self.threshold is None else float(self.threshold)

    @property
    def strict_threshold(self) -> bool:
        return STRATEGIES[self.strategy].strict if self.threshold_strict is None else self.threshold_strict

    @property
    def guided(self) -> bool:
        """Classifier-free guidance is on: an unconditional canvas (the prompt masked) runs beside each row."""
        return self.cfg_scale > 0

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "BlockDiffusionConfig":
        """A config reproducing a reference decoder (see `hf_blockdiff.config.presets`); `overrides` win."""
        config = cls(**preset_fields(name, overrides, cls))
        config._passed = frozenset(with_runtime(overrides)) | {"preset"}
        return config

    @property
    def explicit_fields(self) -> frozenset[str]:
        """Fields passed to the constructor, `replace` or `from_preset`, or unlike the default (the preset's; see
        `config.record`). `cfg.replace` records the names it is given; a `dataclasses.replace` copy counts every
        field as set."""
        return explicit_fields(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "BlockDiffusionConfig":
        """A copy with `changes`; a field the preset derives from a changed one (Dream's block size from
        max_new_tokens) follows it unless it was set. Runtime options among `changes` change `runtime`'s fields."""
        changes = with_runtime(changes, self.runtime)
        preset = PRESETS.get(self.preset)
        derived = {target: source for target, source in (preset.derived if preset else {}).items()
                   if source in changes and target not in changes}
        explicit = self.explicit_fields if derived else frozenset()  # it builds the preset's config: only when needed
        follows = {target: changes[source] for target, source in derived.items() if target not in explicit}
        config = dataclasses.replace(self, **changes, **follows)
        config._passed = self._passed | frozenset(changes)
        return config

    def resolved(self, profile: ModelProfile, vocab_size: int | None = None) -> "BlockDiffusionConfig":
        """A copy with every profile field filled in, or a ValueError that says how to set what is missing."""
        check_against_profile(self, profile)
        filled = {name: getattr(profile, name) for name in PROFILE_FIELDS if getattr(self, name) is None}
        if self.block_size is None:
            filled["block_size"] = decoded_block_size(self, profile)
        cfg = dataclasses.replace(self, **{k: v for k, v in filled.items() if v is not None})
        if cfg.mask_token_id is None:
            raise ValueError(
                "No mask token id is known for this model: pass BlockDiffusionConfig(mask_token_id=...) or set "
                "`model.config.mask_token_id`."
            )
        if cfg.block_size is None and cfg.attention == "bidirectional":
            cfg.block_size = cfg.max_new_tokens  # one block over the whole generation, as Dream decodes
        if cfg.block_size is None:
            raise ValueError(
                "No block size is known for this model: pass BlockDiffusionConfig(block_size=...) or set "
                "`model.config.block_size`."
            )
        if cfg.attention is None:
            raise ValueError(
                "This model has no block-diffusion profile: pass BlockDiffusionConfig(attention='block_causal' or "
                "'bidirectional') (and alignment/logit_shift if they differ from the defaults)."
            )
        if cfg.alignment is None:
            cfg.alignment = "absolute" if cfg.attention == "block_causal" else "prompt_end"
        if cfg.prompt_attention is None:
            staircase = cfg.attention == "block_causal" and cfg.alignment == "absolute"
            cfg.prompt_attention = "block_causal" if staircase else "bidirectional"
        check_modes(cfg)
        if cfg.logit_shift is None:
            cfg.logit_shift = False
        if cfg.steps_per_block is None:
            cfg.steps_per_block = cfg.block_size
        if cfg.minimal_topk is not None:
            cfg.steps_per_block = min(cfg.steps_per_block, cfg.max_new_tokens // cfg.minimal_topk)
        if cfg.pad_token_id is None:
            cfg.pad_token_id = cfg.stop_ids[0] if cfg.stop_ids else cfg.mask_token_id
        if isinstance(cfg.eos_token_id, tuple):
            cfg.eos_token_id = list(cfg.eos_token_id)
        cfg._validate()
        check_ids(cfg, vocab_size)
        return cfg


record_passed_fields(BlockDiffusionConfig)
route_runtime_keywords(BlockDiffusionConfig)  # outermost: the record sees `runtime`, not the keywords
