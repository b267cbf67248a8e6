"""Fidelity to the released checkpoints: their `config.json` in and out, and all of their weights in.

The diffusion checkpoints we load (SDAR, LLaDA, Dream, Fast-dLLM v2) ship a `config.json` written for their own
remote code under transformers 4.x. Our config classes load it unchanged and `save_pretrained` writes it back with the
same keys, so a saved checkpoint still loads with the released remote code; our model classes refuse a checkpoint
that lacks some of their weights.
"""

from __future__ import annotations

from torch import nn
from transformers import PreTrainedModel


class ReleasedConfig:
    """Mixin for a `PreTrainedConfig` subclass (put it first in the bases).

    - An `attn_implementation` key in the file is the remote code's own setting (SDAR ships `"flex_attention"`, which
      its training code needs), not the user's choice: it is kept for saving but does not select our attention, so the
      transformers default (sdpa) applies unless `from_pretrained(..., attn_implementation=...)` asks otherwise.
    - transformers 5 folds `rope_theta`/`rope_scaling` into `rope_parameters` and `torch_dtype` into `dtype`; the
      released remote code reads only the legacy keys (a missing `rope_theta` silently becomes 10000 there), so
      `to_dict` writes them next to the new ones. transformers reads every key of `to_dict` back as an attribute
      while loading; `torch_dtype` answers as `dtype` here, so that read does not hit the deprecated property.
    """

    @property
    def torch_dtype(self):
        return self.dtype

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        config_dict = dict(config_dict)
        released_attention = config_dict.pop("attn_implementation", None)
        loaded = super().from_dict(config_dict, **kwargs)
        config = loaded[0] if isinstance(loaded, tuple) else loaded
        if released_attention is not None:
            config.released_attn_implementation = released_attention
        return loaded

    def to_dict(self):
        output = super().to_dict()
        released_attention = output.pop("released_attn_implementation", None)
        if released_attention is not None:
            output["attn_implementation"] = released_attention
        if output.get("dtype") is not None:
            output["torch_dtype"] = output["dtype"]
        rope = output.get("rope_parameters")
        if isinstance(rope, dict) and "rope_theta" in rope:
            output["rope_theta"] = rope["rope_theta"]
            scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
            output["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
        return output


class CompleteCheckpoint:
    """Mixin for our model classes (put it first in the bases): `from_pretrained` raises when the checkpoint lacks
    weights of the model.

    transformers 5 only logs missing weights and initializes them at random (a mis-shaped weight already raises). For
    these families a missing tensor means a truncated checkpoint or one of another family, whose generations would be
    meaningless with nothing but a log line to show for it. Weights tied by the config are not missing.
    `from_pretrained(None, config=..., state_dict={})` names no checkpoint at all: every weight is initialized at
    random, as `from_config` does (how tensor-parallel random weights are built, each process only its shards).
    """

    @classmethod
    def from_pretrained(cls, *args, output_loading_info=False, **kwargs):
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        if info["missing_keys"] and not (path is None and kwargs.get("state_dict") == {}):
            raise ValueError(
                f"{cls.__name__}.from_pretrained: the checkpoint has no weights for {sorted(info['missing_keys'])}."
            )
        return (model, info) if output_loading_info else model


class OwnDecoderLM:
    """Mixin for a stock causal-LM class (put it before the stock class in the bases) whose decoder is our
    `decoder_class`: the stock `__init__` would build the stock decoder first and throw it away. `config_attributes`
    are copied from the config as the stock `__init__` does."""

    decoder_class: type
    config_attributes: tuple[str, ...] = ()

    def __init__(self, config):
        PreTrainedModel.__init__(self, config)
        self.model = self.decoder_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for name in self.config_attributes:
            setattr(self, name, getattr(config, name))
        self.post_init()
