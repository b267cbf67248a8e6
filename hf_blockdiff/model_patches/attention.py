"""The attention pattern of a plain forward: block-causal (SDAR, Fast-dLLM v2) or bidirectional (LLaDA, Dream).

The masks are built with transformers' own mask utilities, so they follow the model's attention implementation (a
boolean mask for sdpa, a float mask for eager, a `BlockMask` for flex) and respect a 2D padding `attention_mask` and a
cache. They are always materialized: a skipped (`None`) mask would make sdpa fall back to `is_causal`, and the stock
decoder forwards would rebuild a causal mask from it. An attention implementation without a mask function (such as
the one the decode loop registers) gets `None` and applies its own rule. A `dict` passed as `attention_mask` is a mask
mapping prepared by the caller and is used as is; a 3-D or 4-D one is an explicit mask (`released/masks.py`).

The decoders also take the cache keywords of their family's released generate scripts (`released/calls.py`).
"""

from __future__ import annotations

from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

from ..cache.keyword import cache_kwarg, kv_cache_argument
from .released.calls import plain_call
from .released.masks import explicit_attention_mask, is_explicit_mask


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
        config, inputs_embeds, attention_mask, **cache_kwarg(past_key_values), allow_is_bidirectional_skip=False
    )


def forward_mask(pattern, config, inputs_embeds, attention_mask, past_key_values, position_ids):
    """The mask of one forward: a prepared mask mapping as is, an explicit 3-D/4-D mask in place of the pattern, else
    `pattern` (with the padding of a 2-D `attention_mask`)."""
    if isinstance(attention_mask, dict):
        return attention_mask
    if is_explicit_mask(attention_mask):
        return explicit_attention_mask(config, inputs_embeds, attention_mask, past_key_values)
    return pattern(config, inputs_embeds, attention_mask, past_key_values, position_ids)


class _PatternedDecoder:
    """Mixin for a stock decoder base model (put it first in the bases): its forward applies `_mask` instead of the
    causal mask, and `_released_call` reads the family's released cache keywords. It changes no parameter, so weights
    and their names stay those of the stock model."""

    _mask = staticmethod(block_causal_mask)
    _released_call = staticmethod(plain_call)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs):
        past_key_values = kv_cache_argument(past_key_values, kwargs)
        if inputs_embeds is None:  # the mask needs the embeddings (shape, dtype, device): embed once, here
            inputs_embeds, input_ids = self.get_input_embeddings()(input_ids), None
        query_length = inputs_embeds.shape[1]
        call = self._released_call(self.config, past_key_values, use_cache, query_length, kwargs)
        if position_ids is None:
            position_ids = call.position_ids(query_length, inputs_embeds.device)
        cache = call.layers_cache
        attention_mask = forward_mask(self._mask, self.config, inputs_embeds, attention_mask, cache, position_ids)
        return_dict = kwargs.pop("return_dict", None)
        output = call.finish(super().forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, **cache_kwarg(cache),
            inputs_embeds=inputs_embeds, use_cache=use_cache, return_dict=True, **kwargs,
        ))
        return output.to_tuple() if return_dict is False else output


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


def attend(module, query, key, value, attention_mask, past_key_values, **kwargs):
    """The attention of our own attention modules (LLaDA, LLaDA2): K/V into `past_key_values` when one is given,
    then the configured transformers attention function (eager when none is set), which receives `kwargs` as is.
    `module` carries `config`, `layer_idx`, `scaling` and `num_key_value_groups`; returns [B, W, heads·head_dim]."""
    if past_key_values is not None:
        key, value = past_key_values.update(key, value, module.layer_idx)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager_attention_forward)
    attended, _ = attention(
        module, query, key, value, attention_mask,
        dropout=module.config.attention_dropout if module.training else 0.0, scaling=module.scaling, **kwargs,
    )
    return attended.reshape(*attended.shape[:2], -1)
