"""Compatibility presets (docs/fidelity.md, "Presets"): BlockDiffusionConfig fields that reproduce a reference decoder.

Each preset pins what changes tokens (attention, alignment, strategy and its comparison, schedule, precision of the
scores, the reference's extra rules); what the model profile knows (mask id, logit shift, stop ids, and attention
where the reference follows the checkpoint, as d3LLM's) is left to the profile unless the reference fixes it. A
preset's block size is a default: a checkpoint trained with a block size decodes at that size, and the schedule
follows (S = B unless set). Overrides passed to `BlockDiffusionConfig.from_preset(name, **overrides)` win over the
preset.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Preset:
    fields: dict
    summary: str
    source: str
    derived: dict = field(default_factory=dict)  # field -> another field whose value it takes when not given
    made_for: dict = field(default_factory=dict)  # profile facts of the checkpoints it decodes, where it differs
    block_size: int | None = None  # the reference's, for checkpoints trained without one (docs/fidelity.md, "Presets")


# d3LLM's multi-block decoders (docs/fidelity.md, "Presets"): what its Dream and LLaDA loops share. No attention:
# d3LLM decodes its bidirectional checkpoints by full recompute, block-causal ones take the same rules with the cache.
_D3LLM = dict(alignment="prompt_end", max_active_blocks=1 << 20, block_add_threshold=0.5,
              decoded_token_threshold=0.5, add_activation_threshold=0.5, strategy="entropy_threshold",
              score_precision="float64", eos_fill=True)

# diffusers' LLaDA2Pipeline + BlockRefinementScheduler (docs/fidelity.md, "Presets"): what its two settings share. Its
# default 32 steps per block of 32 is S = B, the config's default; minimal_topk=1 caps S at max_new_tokens, as it does.
_LLADA2 = dict(attention="block_causal", alignment="absolute", logit_shift=False, strategy="low_confidence_dynamic",
               threshold=0.7, threshold_strict=True, fallback="topk", minimal_topk=1)

PRESETS: dict[str, Preset] = {
    "sdar": Preset(
        dict(attention="block_causal", alignment="absolute", logit_shift=False, strategy="low_confidence_dynamic",
             threshold=0.85, fallback="topk", fused_store=False),
        "absolute blocks, staircase prefill, prompt tail in block 1, read-only denoise, one store forward per block",
        "JetAstra/SDAR generate.py",
    ),
    "llada": Preset(
        dict(attention="bidirectional", alignment="prompt_end", logit_shift=False, strategy="low_confidence_static",
             confidence="raw", score_precision="float64"),
        "full recompute of the canvas, get_num_transfer_tokens per block, float64 softmax and Gumbel-max",
        "ML-GSAI/LLaDA generate.py",
        block_size=32,
    ),
    "dream": Preset(
        dict(attention="bidirectional", alignment="prompt_end", logit_shift=True, strategy="entropy"),
        "one block over all new tokens, Dream's linspace schedule, scores by negative entropy",
        "Dream generation_utils.py (diffusion_generate, alg='entropy')",
        derived=dict(block_size="max_new_tokens"),
    ),
    "fast_dllm": Preset(
        dict(attention="bidirectional", alignment="prompt_end", strategy="confidence_threshold", threshold=0.9,
             threshold_strict=False, approx_cache="dual", score_precision="float64"),
        "threshold parallel decoding ({c ≥ τ} ∪ top-1; strategy='confidence_factor' for the factor rule) with the "
        "dual (or approx_cache='prefix') approximate cache refreshed at each block start",
        "NVlabs/Fast-dLLM llada/generate.py",
        block_size=32,
    ),
    "fast_dllm_v2": Preset(
        dict(attention="block_causal", alignment="absolute", logit_shift=True, sub_block_size=8,
             strategy="confidence_threshold", threshold=0.9, threshold_strict=True, fused_store=False,
             first_token_on_store=True),
        "blocks decoded sub-block by sub-block with {c > τ} ∪ argmax; the forward storing a block also decides "
        "the next block's first token",
        "NVlabs/Fast-dLLM v2 generate",
    ),
    "d3llm": Preset(
        dict(_D3LLM, logit_shift=True, threshold=0.9),
        "multi-block: add at progress ≥ 0.5, full activation at predecessor ≥ 0.5, {H < τ} plus the lowest H of the "
        "lowest fully activated block when none passes there, EOS fill; attention follows the model (bidirectional: "
        "the whole canvas recomputed each step, as d3LLM; block-causal: the exact cache)",
        "d3LLM d3llm_dream_generate_util.py (_sample_multi_block, alg='entropy_threshold')",
        block_size=32,
    ),
    "d3llm_llada": Preset(
        dict(_D3LLM, logit_shift=False, threshold=0.5, threshold_strict=False, forced_token_scope="all_active"),
        "the d3llm rules with {H ≤ τ}, no logit shift, and also the lowest H of all active blocks when none passes "
        "in any of them; attention follows the model",
        "d3LLM d3llm_llada_generate_util.py (generate_multi_block, get_transfer_index_entropy)",
        block_size=32,
    ),
    "llada2": Preset(
        _LLADA2,
        "absolute blocks of 32 or the checkpoint's size (prompt tail in the first), {c > 0.7}, else the n_t most "
        "confident (n_t over S = B steps, at most max_new_tokens // minimal_topk); editing off",
        "diffusers LLaDA2Pipeline + BlockRefinementScheduler (editing_threshold=None)",
        block_size=32,
    ),
    "llada2_1": Preset(
        dict(_LLADA2, editing_threshold=0.5, max_post_steps=16),
        "the llada2 rules with editing: decided tokens of the active block take a different proposal of confidence "
        "> 0.5; a block filled early keeps refining while its steps edit, up to 16 + 1 such steps",
        "diffusers LLaDA2Pipeline + BlockRefinementScheduler (editing_threshold=0.5, max_post_steps=16)",
        block_size=32,
    ),
    "diffulex_edit": Preset(
        dict(_LLADA2, strategy="confidence_threshold", threshold=0.9, editing_threshold=0.4, remask_threshold=0.4,
             max_post_steps=16),
        "Diffulex's edit decoding with DMax remasking at its defaults: {c > 0.9} of the masks, else the most "
        "confident; decided tokens of the active block with c < 0.4 turn back into masks, the others take a "
        "differing proposal; a filled block refines until a step changes nothing (at most 16 + 1 such steps), and "
        "its (S + 16)-th step commits what is left (S = B, 32 unless the checkpoint's size differs)",
        "Diffulex LLaDA2 edit sampler (sampling_mode='edit': accept_threshold=0.9, edit_threshold=0, "
        "max_post_edit_steps=16) + DMax remask_threshold=0.4 (docs/fidelity.md, \"Presets\")",
        block_size=32,
    ),
    "dllm_var": Preset(
        dict(attention="block_causal", alignment="absolute", prompt_attention="bidirectional", logit_shift=False,
             strategy="low_confidence_dynamic", threshold=0.9, fallback="topk", fused_store=False),
        "dLLM-Var (a LLaDA checkpoint) as JetEngine serves it: absolute blocks of 64 with the exact cache, the "
        "prompt's whole blocks prefilled seeing each other, {c > 0.9} else the most confident, one store forward "
        "per block",
        "JetEngine LLM(mask_token_id=126336, block_length=64) + SamplingParams(remasking_strategy="
        "'low_confidence_dynamic', dynamic_threshold=0.9, denoising_steps=64) (docs/fidelity.md, \"Presets\")",
        made_for=dict(attention="bidirectional", alignment="prompt_end"),  # LLaDA's profile: same model_type
        block_size=64,
    ),
}


# transformers' DiffusionGemmaGenerationConfig defaults, taken where the checkpoint's generation config leaves a canvas
# field unset (docs/fidelity.md, "DiffusionGemma"); config field -> value
DIFFUSION_GEMMA_DEFAULTS = dict(max_denoising_steps=48, entropy_bound=0.1, t_max=0.8, t_min=0.4, stop_stability=1,
                                stop_confidence=0.005)
PRESETS["diffusion_gemma"] = Preset(
    {},
    "DiffusionGemma's own decoding: uniform-noise canvases of canvas_length denoised for up to max_denoising_steps "
    "steps at temperatures t_max → t_min, entropy-bound acceptance with renoising, self-conditioning, adaptive "
    "stopping; its settings come from the checkpoint's generation config (else transformers' defaults) and each "
    "field overrides them",
    "transformers DiffusionGemmaForBlockDiffusion.generate (DiffusionGemmaGenerationMixin), tested token for token",
)


def preset_pins(name: str | None) -> dict:
    """The fields preset `name` pins (none for None)."""
    return {} if name is None else dict(PRESETS[name].fields)


def preset_fields(name: str, overrides: dict, defaults: type) -> dict:
    """Keyword arguments of BlockDiffusionConfig for preset `name` with `overrides` applied; `defaults` (the config
    class) supplies the default of a field another one is derived from."""
    if name not in PRESETS:
        raise ValueError(f"Unknown preset {name!r}: choose one of {', '.join(PRESETS)}.")
    preset = PRESETS[name]
    values = {**preset.fields, **overrides, "preset": name}
    for target, source in preset.derived.items():
        if target not in overrides:
            values[target] = values.get(source, getattr(defaults, source))
    return values
