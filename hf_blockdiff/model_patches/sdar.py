"""SDAR (JetAstra, `model_type: sdar`): the Qwen3 architecture and weight names, decoded block-causally.

The released `modeling_sdar.py` is transformers' Qwen3 (q/k RMSNorm on the head dim, no biases) with a different
attention: in training a flex mask over `[noisy | clean]` copies of the sequence, at inference the mask the caller
passes (its `generate.py` passes the block-causal staircase over blocks of `block_size`, prompt included), and no mask
at all raises. Our plain forward applies that staircase itself, so `model(input_ids)` returns the logits SDAR's
reference prefill and denoising steps see; `generate.py`'s own calls (its float 0/1 [1, q, k] mask, `store_kv`) are
accepted as well (`released/masks.py`, `released/calls.py`).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3Model

from .attention import BlockCausalDecoder
from ..config.profiles import ModelProfile
from .released.checkpoint import CompleteCheckpoint, OwnDecoderLM, ReleasedConfig
from .released.calls import sdar_call

PROFILE = ModelProfile(
    mask_token_id=151669, attention="block_causal", alignment="absolute", logit_shift=False,
    eos_token_id=(151645, 151643),  # <|im_end|>, <|endoftext|>: the released generation_config.json
)


@strict
class SDARConfig(ReleasedConfig, Qwen3Config):
    model_type = "sdar"

    block_size: int = 4
    mask_token_id: int = 151669


class SDARModel(CompleteCheckpoint, BlockCausalDecoder, Qwen3Model):
    """Qwen3 decoder whose plain forward is block-causal over blocks of `config.block_size`."""

    config_class = SDARConfig
    _released_call = staticmethod(sdar_call)


class SDARForCausalLM(CompleteCheckpoint, OwnDecoderLM, Qwen3ForCausalLM):
    """Qwen3 causal LM on `SDARModel`; loads the released SDAR checkpoints (weights unchanged)."""

    config_class = SDARConfig
    _supports_flash_attn = False
    decoder_class = SDARModel
