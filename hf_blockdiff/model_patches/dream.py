"""Dream (HKUNLP, `model_type: Dream`): the Qwen2 architecture and weight names, attention bidirectional everywhere.

The released `modeling_dream.py` is Qwen2 (q/k/v with bias, `o_proj` without) whose attention has `is_causal=False`
and only applies the mask it is given (a padding mask, or none), so its plain forward is bidirectional; ours is too.
Dream predicts token i from position i-1 (logit shift). As released, `DreamModel` is the language model (what the
config's `architectures` and `auto_map["AutoModel"]` name; there is no `AutoModelForCausalLM` entry) and
`DreamBaseModel` the decoder without head.

Released call forms: `generation_utils.py` calls `model(x, "full", tok_idx)` (no mask, default positions when
`tok_idx` is None) or `model(x, mask, tok_idx)` with a boolean [b, 1, n, n] mask and per-row positions; Fast-dLLM
v1's `generation_utils_block.py` adds `use_cache=True`, cache tuples [batch, length, width] sliced to a prefix, and
`dual_cache=True` with `replace_position` (`released/calls.py`). Any other string mask is refused.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model

from .attention import BidirectionalDecoder
from ..config.profiles import ModelProfile
from .released.checkpoint import CompleteCheckpoint, OwnDecoderLM, ReleasedConfig
from .released.calls import dream_call

PROFILE = ModelProfile(
    mask_token_id=151666, attention="bidirectional", alignment="prompt_end", logit_shift=True,
    eos_token_id=151643,  # <|endoftext|>: the released generation_config.json
)


@strict
class DreamConfig(ReleasedConfig, Qwen2Config):
    model_type = "Dream"

    mask_token_id: int | None = 151666


class DreamBaseModel(CompleteCheckpoint, BidirectionalDecoder, Qwen2Model):
    """Qwen2 decoder whose plain forward is bidirectional (padding mask only)."""

    config_class = DreamConfig
    _released_call = staticmethod(dream_call)

    def forward(self, input_ids=None, attention_mask=None, *args, **kwargs):
        if isinstance(attention_mask, str):  # Dream's name for "no mask": every token sees every token
            if attention_mask != "full":
                raise ValueError(f"attention_mask={attention_mask!r}: the only named mask is Dream's 'full'.")
            attention_mask = None
        return super().forward(input_ids, attention_mask, *args, **kwargs)


class DreamModel(CompleteCheckpoint, OwnDecoderLM, Qwen2ForCausalLM):
    """Qwen2 causal LM on `DreamBaseModel`; loads the released Dream checkpoints (weights unchanged)."""

    config_class = DreamConfig
    decoder_class = DreamBaseModel
