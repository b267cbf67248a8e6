"""Decoding profiles: what a checkpoint family needs to be decoded correctly.

A profile holds the facts of docs/fidelity.md, "Model families" (mask id, block size, attention rule, block alignment, logit shift, stop
ids). `profile_for(config)` merges, in order of precedence, the attributes the model config carries
(`mask_token_id`, `block_size`/`bd_size`, ...) over the family defaults registered for its `model_type`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

ATTENTIONS = ("block_causal", "bidirectional")
ALIGNMENTS = ("absolute", "prompt_end")


@dataclass(frozen=True)
class ModelProfile:
    mask_token_id: int | None = None
    block_size: int | None = None
    attention: str | None = None
    alignment: str | None = None
    logit_shift: bool | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None

    @property
    def trained_block_size(self) -> int | None:
        """The block size the checkpoint was trained with: a block-causal model's (its attention mask is built from
        it); a bidirectional model sees the whole sequence, and its block size is only a decoding default."""
        return self.block_size if self.attention == "block_causal" else None

    def merged_over(self, base: "ModelProfile") -> "ModelProfile":
        """This profile's set fields over `base`'s."""
        return replace(base, **{f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None})


_FAMILY_PROFILES: dict[str, ModelProfile] = {}

# config attribute names that carry profile fields, first match wins
_CONFIG_ALIASES = {
    "mask_token_id": ("mask_token_id", "mask_id"),
    "block_size": ("block_size", "bd_size"),
    "attention": ("diffusion_attention",),
    "alignment": ("block_alignment",),
    "logit_shift": ("logit_shift",),
}


def register_profile(model_type: str, profile: ModelProfile) -> None:
    _FAMILY_PROFILES[model_type] = profile


def registered_model_types() -> tuple[str, ...]:
    return tuple(sorted(_FAMILY_PROFILES))


def _config_profile(config) -> ModelProfile:
    values = {}
    for name, aliases in _CONFIG_ALIASES.items():
        for alias in aliases:
            value = getattr(config, alias, None)
            if value is not None:
                values[name] = value
                break
    return ModelProfile(**values)


def profile_for(config) -> ModelProfile:
    """The decoding profile of a model config: config attributes over the family's registered defaults.

    A config of an unregistered family that names a block size but no attention rule is taken as block-causal with
    absolute blocks and no logit shift (how SDAR-style block-diffusion checkpoints are trained)."""
    profile = _config_profile(config)
    family = _FAMILY_PROFILES.get(getattr(config, "model_type", None))
    if family is not None:
        return profile.merged_over(family)
    if profile.block_size is not None:
        return profile.merged_over(ModelProfile(attention="block_causal", alignment="absolute", logit_shift=False))
    return profile


def model_profile(model) -> ModelProfile:
    """The decoding profile of a loaded model; the stop and pad ids of the model's own generation config (or config)
    win over its family's."""
    generation = getattr(model, "generation_config", None)
    own = ModelProfile(
        eos_token_id=_first_set(getattr(generation, "eos_token_id", None), getattr(model.config, "eos_token_id", None)),
        pad_token_id=_first_set(getattr(generation, "pad_token_id", None), getattr(model.config, "pad_token_id", None)),
    )
    return own.merged_over(profile_for(model.config))


def _first_set(*values):
    return next((v for v in values if v is not None), None)
