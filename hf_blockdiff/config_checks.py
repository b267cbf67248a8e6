"""Checks of a `BlockDiffusionConfig` once the model's profile filled it in (docs/design.md, "Errors"): the
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


def check_modes(cfg) -> None:
    """Modes that exclude each other, once attention and alignment are known."""
    if cfg.approx_cache != "none" and (cfg.attention != "bidirectional" or cfg.max_active_blocks != 1):
        fail("approx_cache", cfg.approx_cache, "approximate caches need attention='bidirectional' and "
             "max_active_blocks=1; block-causal models have an exact cache")
    if cfg.cfg_scale > 0 and (cfg.attention != "bidirectional" or cfg.approx_cache != "none"):
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
    if not cfg.prefix_cache_tokens:
        return
    if cfg.prompt_attention != "block_causal":  # check_modes made that block-causal with absolute blocks
        fail("prefix_cache_tokens", cfg.prefix_cache_tokens, "prefixes are exact and reusable only under "
             "block-causal attention with absolute blocks and a block-causal prompt (a prompt seen as one block "
             "changes with its last token): pass 0 for this mode")
    unit = math.lcm(cfg.page_size, cfg.block_size)
    if cfg.prefix_cache_tokens < unit:
        fail("prefix_cache_tokens", cfg.prefix_cache_tokens, f"it holds no unit of reuse (lcm(page_size, "
             f"block_size) = {unit} tokens): pass at least {unit}, or 0 to turn the store off")


def check_against_profile(cfg, profile: ModelProfile) -> None:
    """A model fact (attention, alignment, logit shift) that contradicts the model's profile: an error when a
    preset pinned it (unless the preset is made for checkpoints with that profile), a warning when the user set it
    (an explicit override stays allowed)."""
    pinned = preset_pins(cfg.preset)
    made_for = PRESETS[cfg.preset].made_for if cfg.preset else {}
    for name in ("attention", "alignment", "logit_shift"):
        value, fact = getattr(cfg, name), getattr(profile, name)
        if fact is None or value is None or value == fact:
            continue
        if name in pinned and pinned[name] == value:
            if made_for.get(name) == fact:
                continue
            raise ValueError(
                f"Preset {cfg.preset!r} decodes with {name}={value!r} but this model's profile has {name}={fact!r}: "
                f"choose a preset for such models, or override it: from_preset({cfg.preset!r}, {name}={fact!r})."
            )
        warnings.warn(f"BlockDiffusionConfig.{name}={value!r} overrides this model's {name}={fact!r}: decoding "
                      "differs from how the model was trained.", stacklevel=5)


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
