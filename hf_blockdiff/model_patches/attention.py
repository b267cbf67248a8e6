"""The attention pattern of a plain forward: block-causal (SDAR, Fast-dLLM v2) or bidirectional (LLaDA, Dream).

The masks are built with transformers' own mask utilities, so they follow the model's attention implementation (a
boolean mask for sdpa, a float mask for eager, a `BlockMask` for flex) and respect a 2D padding `attention_mask` and a
cache. They are always materialized: a skipped (`None`) mask would make sdpa fall back to `is_causal`, and the stock
decoder forwards would rebuild a causal mask from it. An attention implementation without a mask function (such as
the one the decode loop registers) gets `None` and applies its own rule. A `dict` passed as `attention_mask` is a mask
mapping prepared by the caller and is used as is.
"""

from __future__ import annotations

from transformers.masking_utils import create_bidirectional_mask, create_causal_mask


def block_causal_overlay(block_size: int):
    """Mask function: query `q` sees key `k` iff k's block is not after q's (blocks of `block_size` from position 0)."""

    def block_causal(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx // block_size <= q_idx // block_size

    return block_causal


def block_causal_mask(config, inputs_embeds, attention_mask, past_key_values, position_ids):
    return create_causal_mask(
        config,
        inputs_embeds,
        attention_mask,
        past_key_values,
        position_ids=position_ids,
        or_mask_function=block_causal_overlay(config.block_size),
        allow_is_causal_skip=False,
    )


def bidirectional_mask(config, inputs_embeds, attention_mask, past_key_values, position_ids=None):
    """`position_ids` is unused (same signature as `block_causal_mask`)."""
    return create_bidirectional_mask(
        config, inputs_embeds, attention_mask, past_key_values=past_key_values, allow_is_bidirectional_skip=False
    )


class _PatternedDecoder:
    """Mixin for a stock decoder base model (put it first in the bases): its forward applies `_mask` instead of the
    causal mask. It changes no parameter, so weights and their names stay those of the stock model."""

    _mask = staticmethod(block_causal_mask)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, **kwargs):
        if inputs_embeds is None:  # the mask needs the embeddings (shape, dtype, device): embed once, here
            inputs_embeds, input_ids = self.get_input_embeddings()(input_ids), None
        if not isinstance(attention_mask, dict):
            attention_mask = self._mask(self.config, inputs_embeds, attention_mask, past_key_values, position_ids)
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=past_key_values, inputs_embeds=inputs_embeds, **kwargs)


class BlockCausalDecoder(_PatternedDecoder):
    """Block-causal plain forward, blocks of `config.block_size` from position 0 (prompt included). FlashAttention
    cannot express this mask (it would silently run causal), so the flash implementations are refused."""

    _supports_flash_attn = False


class BidirectionalDecoder(_PatternedDecoder):
    """Bidirectional plain forward: every token sees every (non-padding) token."""

    _mask = staticmethod(bidirectional_mask)

    def __init__(self, config):
        super().__init__(config)
        for layer in self.layers:  # sdpa and flash read it from the module when they get no mask
            layer.self_attn.is_causal = False
