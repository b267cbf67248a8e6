"""Checks of a `BlockDiffusionConfig` once the model's profile filled it in (docs/architecture.md, "Errors"): the
combination of modes, the model facts a preset pins against the profile, and the ids against the vocabulary. Each
failure is a ValueError naming the field and the fix, raised before any forward."""

from __future__ import annotations

import math
import warnings
from typing import Any

from .presets import PRESETS, preset_pins
from .profiles import ModelProfile


def fail(name: str, value: Any, fix: str) -> None:
    raise ValueError(f"BlockDiffusionConfig.{name}={value!r} is invalid: {fix}")


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_modes(cfg) -> None:
    """Modes that exclude each other, once attention and alignment are known."""
    if cfg.approx_cache != "none" and (cfg.attention != "bidirectional" or cfg.max_active_blocks != 1):
        fail("approx_cache", cfg.approx_cache, "approximate caches need attention='bidirectional' and "
             "max_active_blocks=1; block-causal models have an exact cache")
    if cfg.guided and (cfg.attention != "bidirectional" or cfg.approx_cache != "none"):
        fail("cfg_scale", cfg.cfg_scale, "classifier-free guidance needs attention='bidirectional' and no "
             "approximate cache")
    if cfg.editing_threshold is not None and (
        cfg.attention != "block_causal" or cfg.max_active_blocks != 1 or not cfg.fused_store
        or cfg.sub_block_size or cfg.first_token_on_store
    ):
        fail("editing_threshold", cfg.editing_threshold, "editing refines the one active block of block-causal "
             "decoding: it needs attention='block_causal', max_active_blocks=1 and fused_store=True, without "
             "sub-blocks (or pass editing_threshold=None)")
    if cfg.first_token_on_store and (cfg.fused_store or not cfg.logit_shift):
        fail("first_token_on_store", True, "it needs fused_store=False and logit_shift=True (Fast-dLLM v2)")
    if cfg.prompt_attention == "block_causal" and (cfg.attention != "block_causal" or cfg.alignment != "absolute"):
        fail("prompt_attention", cfg.prompt_attention, "a staircase over the prompt needs attention='block_causal' "
             "and alignment='absolute' (prompt_end blocks and bidirectional models see the prompt as one block): "
             "pass 'bidirectional' or None")
    check_prefix_store(cfg)


def check_prefix_store(cfg) -> None:
    if not cfg.runtime.prefix_cache_tokens:
        return
    if cfg.prompt_attention != "block_causal":  # check_modes made that block-causal with absolute blocks
        fail("prefix_cache_tokens", cfg.runtime.prefix_cache_tokens, "prefixes are exact and reusable only under "
             "block-causal attention with absolute blocks and a block-causal prompt (a prompt seen as one block "
             "changes with its last token): pass 0 for this mode")
    unit = math.lcm(cfg.runtime.page_size, cfg.block_size)
    if cfg.runtime.prefix_cache_tokens < unit:
        fail("prefix_cache_tokens", cfg.runtime.prefix_cache_tokens, f"it holds no unit of reuse (lcm(page_size, "
             f"block_size) = {unit} tokens): pass at least {unit}, or 0 to turn the store off")


def decoded_block_size(cfg, profile: ModelProfile) -> int | None:
    """The block size `cfg` decodes at (docs/fidelity.md, "Presets"): its own, else the one the checkpoint was trained
    with, else the preset's (a preset describes the decoding, not the checkpoint), else the profile's default."""
    preset = PRESETS[cfg.preset].block_size if cfg.preset else None
    return cfg.block_size or profile.trained_block_size or preset or profile.block_size


def check_against_profile(cfg, profile: ModelProfile) -> None:
    """The config, before the profile fills it in, against the model's profile. What the preset pinned and the
    model contradicts (a model fact, unless the preset is made for checkpoints with that profile; a sub-block size
    that does not divide the block size) is one error listing every conflict and the overrides that lift them all;
    a field equal to the preset's value counts as the preset's. What the user set is allowed with a warning: a model
    fact other than the profile's, a block size other than the one the model was trained with."""
    pinned = preset_pins(cfg.preset)
    made_for = PRESETS[cfg.preset].made_for if cfg.preset else {}
    conflicts, fixes, overridden = [], {}, []
    for name in ("attention", "alignment", "logit_shift"):
        value, fact = getattr(cfg, name), getattr(profile, name)
        if fact is None or value is None or value == fact:
            continue
        if pinned.get(name) != value:
            overridden.append(f"BlockDiffusionConfig.{name}={value!r} overrides this model's {name}={fact!r}")
        elif made_for.get(name) != fact:
            conflicts.append(f"{name}={value!r} but this model's profile has {name}={fact!r}")
            fixes[name] = fact
    if fixes.get("logit_shift") is False and cfg.first_token_on_store:  # check_modes: it needs the shift
        fixes["first_token_on_store"] = False
    sub, block = cfg.sub_block_size, decoded_block_size(cfg, profile)
    if sub is not None and block is not None and pinned.get("sub_block_size") == sub and block % sub:
        conflicts.append(f"sub_block_size={sub} but this model's block_size={block} is not a multiple of it")
        fixes["sub_block_size"] = math.gcd(sub, block)
    if conflicts:
        overrides = ", ".join(f"{name}={value!r}" for name, value in fixes.items())
        raise ValueError(f"Preset {cfg.preset!r} decodes with {', and with '.join(conflicts)}: choose a preset for "
                         f"such models, or override them: from_preset({cfg.preset!r}, {overrides}).")
    trained = profile.trained_block_size
    if trained is not None and cfg.block_size not in (None, trained):
        overridden.append(f"BlockDiffusionConfig.block_size={cfg.block_size} differs from block_size={trained}, the "
                          "block size this model was trained with (leave block_size unset to decode at that size)")
    for message in overridden:  # stacklevel 7: the user's generate_multi_block call, past resolved() and its wrappers
        warnings.warn(f"{message}: decoding differs from how the model was trained.", stacklevel=7)


def check_minimal_topk(cfg) -> None:
    """minimal_topk caps the steps per block at max_new_tokens // minimal_topk (diffusers' LLaDA2Pipeline, which
    bounds it by the generation's length only: a k above the block size leaves one step per block)."""
    k, bound = cfg.minimal_topk, cfg.max_new_tokens
    if k is not None and (not is_int(k) or not 1 <= k <= bound):
        fail("minimal_topk", k, f"pass a positive integer ≤ max_new_tokens ({bound} here), or None "
             "for no cap on the steps")


def check_ids(cfg, vocab_size: int | None) -> None:
    """The mask, stop and pad ids (set here or taken from the profile) exist and do not collide."""
    if cfg.mask_token_id in cfg.stop_ids:
        fail("mask_token_id", cfg.mask_token_id, f"it is also a stop id (eos_token_id={cfg.eos_token_id}): "
             "every undecided position would read as a stop; pass the model's own mask id")
    if vocab_size is None:
        return
    for name, ids in (("mask_token_id", [cfg.mask_token_id]), ("eos_token_id", list(cfg.stop_ids)),
                      ("pad_token_id", [cfg.pad_token_id])):
        if any(not 0 <= i < vocab_size for i in ids):
            fail(name, getattr(cfg, name), f"the model's vocabulary has {vocab_size} ids, [0, {vocab_size}) "
                 "(a value not passed here comes from the model's profile): pass the checkpoint's own id")


def check_canvas_fields(cfg) -> None:
    """DiffusionGemma's canvas settings (docs/fidelity.md, "DiffusionGemma"), where they are set."""
    steps, bound, stability, confidence = (cfg.max_denoising_steps, cfg.entropy_bound, cfg.stop_stability,
                                           cfg.stop_confidence)
    if steps is not None and (not is_int(steps) or steps < 1):
        fail("max_denoising_steps", steps, "pass a positive integer (denoising steps per canvas)")
    if bound is not None and (not is_number(bound) or bound < 0):
        fail("entropy_bound", bound, "pass a non-negative float (a larger bound accepts more tokens per step)")
    for name in ("t_max", "t_min"):
        if getattr(cfg, name) is not None and (not is_number(getattr(cfg, name)) or getattr(cfg, name) < 0):
            fail(name, getattr(cfg, name), "pass a non-negative temperature")
    if cfg.t_max is not None and cfg.t_min is not None and cfg.t_min > cfg.t_max:
        fail("t_min", cfg.t_min, f"the schedule runs from t_max down to t_min: pass t_min ≤ t_max={cfg.t_max}")
    if cfg.t_max is not None and cfg.t_max == 0:
        fail("t_max", cfg.t_max, "the temperature divides the logits: pass t_max > 0")
    if stability is not None and (not is_int(stability) or stability < 0):
        fail("stop_stability", stability, "pass a number of steps ≥ 0 (0: a canvas is stable at once)")
    if confidence is not None and (not is_number(confidence) or confidence <= 0):
        fail("stop_confidence", confidence, "pass a mean entropy > 0 (a tiny one turns adaptive stopping off)")
    if cfg.noise not in ("counter", "torch"):
        fail("noise", cfg.noise, "choose 'counter' (the fast path) or 'torch' (transformers' random stream)")


CANVAS_FIELDS = ("max_denoising_steps", "entropy_bound", "t_max", "t_min", "stop_stability", "stop_confidence", "noise")
# what else a DiffusionGemma decode reads; every other field is a block-diffusion rule it has no use for
CANVAS_RUN_FIELDS = ("max_new_tokens", "eos_token_id", "pad_token_id", "preset", "runtime")
CANVAS_UNREAD_RUNTIME = ("prefix_cache_tokens", "max_batch_size")  # runtime options the canvas engine has no use for


def check_block_config(cfg) -> None:
    """A block-diffusion model (every family but DiffusionGemma) refuses DiffusionGemma's preset and fields."""
    if cfg.preset == "diffusion_gemma":
        fail("preset", cfg.preset, "it decodes DiffusionGemmaForBlockDiffusion checkpoints; choose a preset of this "
             "model's family (or none)")
    defaults = type(cfg)()
    for name in CANVAS_FIELDS:
        if getattr(cfg, name) != getattr(defaults, name):
            fail(name, getattr(cfg, name), "it is a DiffusionGemma canvas setting; this model decodes blocks: "
                 "leave it unset")


def check_canvas_config(cfg) -> None:
    """DiffusionGemma refuses other families' presets and the block-diffusion fields it does not read."""
    if cfg.preset not in (None, "diffusion_gemma"):
        fail("preset", cfg.preset, "DiffusionGemma decodes canvases, not masked blocks: pass "
             "preset='diffusion_gemma' (or none)")
    defaults = type(cfg)()
    for name in cfg.__dataclass_fields__:
        if name not in CANVAS_FIELDS + CANVAS_RUN_FIELDS and getattr(cfg, name) != getattr(defaults, name):
            fail(name, getattr(cfg, name), "DiffusionGemma does not read it (its decoding is set by "
                 f"{', '.join(CANVAS_FIELDS)}): leave it unset")
    for name in CANVAS_UNREAD_RUNTIME:
        if getattr(cfg.runtime, name) != getattr(defaults.runtime, name):
            fail(f"runtime.{name}", getattr(cfg.runtime, name), "DiffusionGemma decodes every prompt of a call at "
                 "once and keeps no prefix store: leave it unset")
    if cfg.runtime.batch_invariant:
        fail("runtime.batch_invariant", True, "DiffusionGemma's layers (MoE experts, sliding and global attention) "
             "have no batch-invariant kernels: leave it False")


def check_editing_fields(cfg) -> None:
    """The fields of editable decoding (LLaDA2.1, Diffulex's edit/DMax rules)."""
    value = cfg.editing_threshold
    if value is not None and (not is_number(value) or not 0.0 < value <= 1.0):
        fail("editing_threshold", value, "pass a confidence in (0, 1], or None to turn editing off")
    steps = cfg.max_post_steps
    if not is_int(steps) or steps < 0:
        fail("max_post_steps", steps, "pass a non-negative integer (refinement steps after a block is filled)")
    rules = (("remask_threshold", cfg.remask_threshold is not None, "pass a confidence in (0, 1], or None to "
              "turn remasking off", lambda v: v is None or (is_number(v) and 0.0 < v <= 1.0)),
             ("stability_threshold", cfg.stability_threshold != 1.0, "pass a fraction in [0, 1] (1: a block "
              "stops refining only after a step that changes nothing)", lambda v: is_number(v) and 0 <= v <= 1),
             ("edit_penalty", cfg.edit_penalty != 0.0, "pass a non-negative number (0: off)",
              lambda v: is_number(v) and v >= 0))
    for name, used, fix, valid in rules:
        if not valid(getattr(cfg, name)):
            fail(name, getattr(cfg, name), fix)
        if used and cfg.editing_threshold is None:
            fail(name, getattr(cfg, name), "it is a rule of editable decoding: set editing_threshold too (or "
                 "use the diffulex_edit preset)")
