"""Tiny random DiffusionGemma models (fp32) and seeded runs of transformers' own `generate` beside ours."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
    pytest.skip("DiffusionGemma needs transformers >= 5.12", allow_module_level=True)

import hf_blockdiff  # noqa: E402,F401  (puts generate_multi_block on the class)
from hf_blockdiff import BlockDiffusionConfig  # noqa: E402

VOCAB, CANVAS, WINDOW = 96, 8, 6

# (name, layer types, experts, top-k): both attention kinds; a real mixture and a single always-taken expert (every
# DiffusionGemma layer has its MoE block; one expert with top-1 is the closest to a dense model it has)
CONFIGS = {
    "mixed_moe": (["sliding_attention", "sliding_attention", "full_attention"], 4, 2),
    "single_expert": (["sliding_attention", "full_attention", "sliding_attention", "full_attention"], 1, 1),
}


def tiny_diffusion_gemma(name: str, seed: int = 0, logit_scale: float = 12.0, vision: dict | None = None,
                         **text_config):
    """A random fp32 DiffusionGemma whose decoder's final norm is scaled by `logit_scale`, so its distributions are
    peaked enough for the entropy bound to accept several tokens per step; `text_config` overrides its text sizes,
    `vision` its (unused, default-sized) vision tower's."""
    layer_types, experts, top_k = CONFIGS[name]
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=len(layer_types),
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                num_global_key_value_heads=1, sliding_window=WINDOW, layer_types=layer_types, num_experts=experts,
                top_k_experts=top_k, moe_intermediate_size=16, max_position_embeddings=256, pad_token_id=0,
                eos_token_id=1, bos_token_id=2) | text_config
    config = transformers.DiffusionGemmaConfig(text_config=text, canvas_length=CANVAS, image_token_id=VOCAB + 10,
                                               vision_config={"model_type": "gemma4_vision", **(vision or {})})
    torch.manual_seed(seed)
    model = transformers.DiffusionGemmaForBlockDiffusion(config).eval()
    with torch.no_grad():
        model.model.decoder.norm.weight.mul_(logit_scale)
    return model


def prompts(lengths: list[int], seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded random prompts (ids 3.. so no pad/eos/bos) and their attention mask."""
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length:] = torch.randint(3, VOCAB, (length,), generator=gen)
        mask[row, width - length:] = 1
    return ids, mask


def settings(steps: int, bound: float, confidence: float, stability: int = 1) -> tuple[dict, dict]:
    """The same canvas settings as transformers' generate kwargs and as our config fields."""
    theirs = dict(max_denoising_steps=steps, t_max=0.8, t_min=0.4, stability_threshold=stability,
                  confidence_threshold=confidence,
                  sampler_config=transformers.models.diffusion_gemma.generation_diffusion_gemma.EntropyBoundSamplerConfig(
                      entropy_bound=bound))
    ours = dict(max_denoising_steps=steps, t_max=0.8, t_min=0.4, stop_stability=stability, stop_confidence=confidence,
                entropy_bound=bound)
    return theirs, ours


def reference(model, ids, mask, new_tokens: int, theirs: dict, seed: int, **special):
    torch.manual_seed(seed)
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, **theirs, **special)


def ours(model, ids, mask, new_tokens: int, fields: dict, seed: int, **config):
    torch.manual_seed(seed)
    cfg = BlockDiffusionConfig(max_new_tokens=new_tokens, **fields, **config)
    return model.generate_multi_block(ids, cfg, attention_mask=mask, return_dict=True)
