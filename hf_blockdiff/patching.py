"""Putting `generate_multi_block` on transformers model classes.

The method is `generation.generate_multi_block` inside two wrappers: the PEFT adapter handling (`lora.over_adapters`:
LoRA layers merged for the call, base weights restored bit-exactly) and a per-model lock, so concurrent calls on one
model from several threads run one after another instead of sharing its decode engine, its attention setting and
its merged weights.
"""

from __future__ import annotations

import functools

from .generation import generate_multi_block
from .generation.lock import model_lock
from .weights.lora import over_adapters

STOCK_CLASSES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM")


def serialized(generate):
    @functools.wraps(generate)
    def locked(model, *args, **kwargs):
        with model_lock(model):
            return generate(model, *args, **kwargs)

    return locked


class BlockDiffusionGenerationMixin:
    """Adds `generate_multi_block` to a transformers causal LM (see `generation.generate_multi_block`)."""

    generate_multi_block = serialized(over_adapters(generate_multi_block))


def diffusion_generate(self, inputs=None, generation_config=None, **kwargs):
    """`generate` of the diffusion families: block diffusion through `generate_multi_block`, with transformers'
    arguments (`input_ids`/`inputs`, `generation_config`, generation parameters as keywords). Returns the LongTensor
    of prompt and new tokens, or the output object with return_dict_in_generate=True, so `pipeline("text-generation")`
    works unchanged (docs/architecture.md)."""
    input_ids = kwargs.pop("input_ids", None) if inputs is None else inputs
    if input_ids is None:
        raise ValueError("generate needs the prompt ids: pass input_ids=tokenizer(text, return_tensors='pt').input_ids.")
    return self.generate_multi_block(input_ids, generation_config, **kwargs)


def patch_class(cls: type) -> type:
    if not hasattr(cls, "generate_multi_block"):
        cls.generate_multi_block = BlockDiffusionGenerationMixin.generate_multi_block
    return cls


def patch_model(model):
    """Give `model` (any transformers decoder-only causal LM) `generate_multi_block`; returns the model."""
    if not hasattr(model, "config") or not hasattr(model, "get_output_embeddings"):
        raise TypeError("patch_model needs a transformers PreTrainedModel with an output embedding (LM head).")
    if hasattr(type(model), "generate_multi_block"):  # a registered family or an already patched class
        return model
    if not _is_decoder_only_causal_lm(model):
        kind = "an encoder-decoder model" if getattr(model.config, "is_encoder_decoder", False) else "no causal LM class"
        raise TypeError(
            f"patch_model needs a decoder-only causal LM (a class AutoModelForCausalLM loads, such as Qwen3ForCausalLM "
            f"or LlamaForCausalLM); {type(model).__name__} is {kind}. Load a decoder-only checkpoint with "
            "AutoModelForCausalLM."
        )
    patch_class(type(model))
    return model


def _is_decoder_only_causal_lm(model) -> bool:
    """Not an encoder-decoder, and a causal-LM class by name (remote-code classes included) or by transformers'
    own mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(model.config, "is_encoder_decoder", False):
        return False
    name = type(model).__name__
    known = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(model.config, "model_type", None), ())
    return name.endswith(("ForCausalLM", "LMHeadModel")) or name in ((known,) if isinstance(known, str) else known)


def patch_known_classes() -> None:
    """The stock Qwen2/Qwen3/Qwen3-MoE/Llama causal LMs and our checkpoint families get `generate_multi_block`."""
    import transformers

    from .model_patches import FAMILIES, register_all

    register_all()
    for name in STOCK_CLASSES:
        patch_class(getattr(transformers, name))
    for _config, _model, causal_lm, _profile in FAMILIES:
        patch_class(causal_lm)
        causal_lm.generate = diffusion_generate  # autoregressive decoding would be meaningless for these checkpoints
    diffusion_gemma = getattr(transformers, "DiffusionGemmaForBlockDiffusion", None)  # transformers ≥ 5.12
    if diffusion_gemma is not None and not hasattr(diffusion_gemma, "generate_multi_block"):
        from .canvas.diffusion_gemma import generate_multi_block as generate_canvases

        diffusion_gemma.generate_multi_block = serialized(generate_canvases)


def free_cache(model) -> None:
    """Release the KV-cache pages (and anything else generation keeps on `model`) so training gets the memory back."""
    with model_lock(model):
        if getattr(model, "_blockdiff_engine", None) is not None:
            model._blockdiff_engine = None
