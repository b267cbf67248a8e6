"""Putting `generate_multi_block` on transformers model classes."""

from __future__ import annotations

from .generation import BlockDiffusionGenerationMixin

STOCK_CLASSES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM")


def patch_class(cls: type) -> type:
    if not hasattr(cls, "generate_multi_block"):
        cls.generate_multi_block = BlockDiffusionGenerationMixin.generate_multi_block
    return cls


def patch_model(model):
    """Give `model` (any transformers causal LM) `generate_multi_block`; returns the model."""
    if not hasattr(model, "config") or not hasattr(model, "get_output_embeddings"):
        raise TypeError("patch_model needs a transformers PreTrainedModel with an output embedding (LM head).")
    patch_class(type(model))
    return model


def patch_known_classes() -> None:
    """The stock Qwen2/Qwen3/Qwen3-MoE/Llama causal LMs and our checkpoint families get `generate_multi_block`."""
    import transformers

    from .model_patches import FAMILIES, register_all

    register_all()
    for name in STOCK_CLASSES:
        patch_class(getattr(transformers, name))
    for _config, _model, causal_lm, _profile in FAMILIES:
        patch_class(causal_lm)


def free_cache(model) -> None:
    """Release the KV-cache pages (and anything else generation keeps on `model`) so training gets the memory back."""
    if getattr(model, "_blockdiff_engine", None) is not None:
        model._blockdiff_engine = None
