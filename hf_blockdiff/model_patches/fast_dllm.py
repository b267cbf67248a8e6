"""Fast-dLLM v2 (NVlabs, `model_type: Fast_dLLM_Qwen`): Qwen2.5 weights, block-causal attention over `bd_size`.

The released `modeling.py` is Qwen2 (q/k/v with bias). Its plain forward is not causal: in eval mode it discards the
given `attention_mask` and applies `block(q) >= block(k)` over absolute positions (blocks of its forward argument
`block_size`, default 32 = the released `bd_size`; training uses `bd_size`), and with its sub-block cache the block's
tokens attend to each other fully. Our `Fast_dLLM_QwenModel` applies the same block-causal rule with `config.bd_size`
(keeping a padding mask if one is given). Its generation reads token i from position i-1 (logit shift).

The cache keywords of its `generation_functions.py` (`update_past_key_values`, `use_block_cache`,
`block_past_key_values`, `replace_position`, `block_size`) are accepted (`released/calls.py`); the causal LM returns
`block_past_key_values` beside `past_key_values` when a block cache is in use, as the released one does, and has the
released model's `sample_with_top_p`, which that script calls on the model.
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

from .attention import BlockCausalDecoder
from ..config.profiles import ModelProfile
from .released.checkpoint import CompleteCheckpoint, OwnDecoderLM, ReleasedConfig
from .released.calls import BlockCacheCausalLMOutput, block_cache_for, fast_dllm_v2_call

PROFILE = ModelProfile(
    mask_token_id=151665, attention="block_causal", alignment="absolute", logit_shift=True,
    eos_token_id=151645,  # <|im_end|>, the reference's stop token
)


@strict
class Fast_dLLM_QwenConfig(ReleasedConfig, Qwen2Config):
    model_type = "Fast_dLLM_Qwen"
    attribute_map = {"block_size": "bd_size"}

    bd_size: int = 32


class Fast_dLLM_QwenModel(CompleteCheckpoint, BlockCausalDecoder, Qwen2Model):
    """Qwen2 decoder whose plain forward is block-causal over blocks of `config.bd_size`."""

    config_class = Fast_dLLM_QwenConfig
    _released_call = staticmethod(fast_dllm_v2_call)


class Fast_dLLM_QwenForCausalLM(CompleteCheckpoint, OwnDecoderLM, Qwen2ForCausalLM):
    """Qwen2 causal LM on `Fast_dLLM_QwenModel`; loads the released Fast-dLLM v2 checkpoints (weights unchanged)."""

    config_class = Fast_dLLM_QwenConfig
    _supports_flash_attn = False
    decoder_class = Fast_dLLM_QwenModel

    def forward(self, *args, **kwargs):
        block_cache = block_cache_for(self.config, kwargs)  # the decoder fills it; the stock LM output drops it
        if block_cache is None:
            return super().forward(*args, **kwargs)
        return_dict = kwargs.pop("return_dict", None)
        output = BlockCacheCausalLMOutput(**super().forward(*args, **kwargs), block_past_key_values=block_cache)
        return output.to_tuple() if return_dict is False else output

    @staticmethod
    def sample_with_top_p(logits, top_p=0.95, temperature=1.0):
        """(tokens, the distribution they come from) for `logits` [..., vocab]. Temperature 0: the argmax and the
        softmax. Otherwise the softmax at `temperature` cut to its nucleus (the most likely tokens until their
        probability reaches `top_p`), renormalized, and one draw per position: in every row, where the released
        helper draws the first row's."""
        if not temperature:
            probs = logits.softmax(-1)
            return probs.argmax(-1), probs
        probs = (logits / temperature).softmax(-1)
        ordered, order = probs.sort(-1, descending=True)
        beyond_nucleus = ordered.cumsum(-1) - ordered > top_p
        probs = probs.masked_fill(torch.zeros_like(beyond_nucleus).scatter(-1, order, beyond_nucleus), 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
        tokens = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).reshape(probs.shape[:-1])
        return tokens, probs
