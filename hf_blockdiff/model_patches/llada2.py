"""LLaDA2.x (inclusionAI, `model_type: llada2_moe`): a Ling-2.0 MoE transformer decoded block-causally.

What the released `modeling_llada2_moe.py` computes: pre-RMSNorm layers; attention with one fused `query_key_value`
projection ([q heads | k heads | v heads], no bias), RMSNorm on each head of q and k (`query_layernorm`,
`key_layernorm`), rotate-half RoPE on the first `partial_rotary_factor` of each head, scale `head_dim^-0.5`, output
`dense`; the first `first_k_dense_replace` layers have a SwiGLU MLP, the others an MoE: float32 router logits,
sigmoid scores, experts chosen on `score + expert_bias` among the `topk_group` best of `n_group` groups (a group
scores the sum of its top two), weights = the chosen sigmoid scores renormalized and times `routed_scaling_factor`,
plus `num_shared_experts` shared SwiGLU experts. Its `generate` passes a block-causal mask over blocks of 32 from
position 0 (additive 4-D, prompt included) and reads the logits of the last block unshifted.

transformers' GLM-4-MoE has this routing and expert layout, so its router, experts and MLPs are reused; the
attention, layer and decoder are ours, named as released. Two names differ from the checkpoint: experts are fused
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`) and the router's bias is `e_score_correction_bias`;
`register_checkpoint_conversion` converts them at load and back at save.
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import PreTrainedConfig
from transformers.cache_utils import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.models.glm4_moe.configuration_glm4_moe import Glm4MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import (Glm4MoeForCausalLM, Glm4MoeMLP, Glm4MoeMoE,
                                                            Glm4MoePreTrainedModel, Glm4MoeRMSNorm,
                                                            apply_rotary_pos_emb)

from .attention import attend, block_causal_mask
from ..cache.keyword import cache_kwarg, kv_cache_argument
from .experts import ReleasedExperts
from .llada import rope_angles
from ..config.profiles import ModelProfile
from .released.checkpoint import CompleteCheckpoint, OwnDecoderLM, ReleasedConfig

PROFILE = ModelProfile(
    mask_token_id=156895, attention="block_causal", alignment="absolute", logit_shift=False,
    eos_token_id=156892, pad_token_id=156892,  # <|endoftext|>: the released generate's eos_id and config pad id
)


@strict
class LLaDA2MoeConfig(ReleasedConfig, PreTrainedConfig):
    """The released LLaDA2 config keys (defaults: LLaDA2.0-mini); GLM-4-MoE's names map onto them."""

    model_type = "llada2_moe"
    attribute_map = {"num_local_experts": "num_experts", "n_shared_experts": "num_shared_experts"}
    # GLM-4-MoE's experts plan (the same module names), in the form of the installed transformers (their forms differ:
    # weights/sharding.py)
    base_model_ep_plan = Glm4MoeConfig.base_model_ep_plan
    base_model_tp_plan = {  # the fused q/k/v projection cannot be split by heads: attention stays replicated
        "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
        "layers.*.mlp.experts.down_proj": "rowwise",
        "layers.*.mlp.experts": "moe_tp_experts",
        "layers.*.mlp.shared_experts.gate_proj": "colwise",
        "layers.*.mlp.shared_experts.up_proj": "colwise",
        "layers.*.mlp.shared_experts.down_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }

    vocab_size: int = 157184
    hidden_size: int = 2048
    intermediate_size: int = 5120
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 128
    hidden_act: str = "silu"
    use_qkv_bias: bool = False
    use_bias: bool = False
    use_qk_norm: bool = True
    rms_norm_eps: float = 1e-6
    partial_rotary_factor: float = 0.5
    rope_theta: float | int = 600000
    rope_scaling: dict | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    attention_dropout: float = 0.0
    num_experts: int = 256
    num_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    moe_intermediate_size: int = 512
    first_k_dense_replace: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    score_function: str = "sigmoid"
    output_router_logits: bool = False
    use_cache: bool = True
    pad_token_id: int | None = 156892
    eos_token_id: int | list[int] | None = 156892
    # ours, not a released key: the block size of the plain forward and of decoding (the released generate's
    # block_length, as in diffusers' BlockRefinementScheduler)
    block_size: int = 32

    def __post_init__(self, **kwargs):
        self._check_layout()
        super().__post_init__(**kwargs)

    def _check_layout(self):
        if self.num_experts % self.n_group:
            raise ValueError(
                f"LLaDA2 config: `n_group={self.n_group}` does not divide `num_experts={self.num_experts}`; the router "
                "splits the experts into `n_group` equal groups: set `n_group` to a divisor of `num_experts`."
            )
        fixed = {"score_function": "sigmoid", "use_qkv_bias": False, "use_bias": False, "use_qk_norm": True,
                 "rope_scaling": None}
        for key, value in fixed.items():
            if getattr(self, key) != value:
                raise ValueError(f"LLaDA2 config `{key}={getattr(self, key)!r}` is not supported (only {value!r}).")


class LLaDA2MoeAttention(nn.Module):
    """The released attention: fused `query_key_value`, per-head q/k RMSNorm, partial RoPE, `dense` output. It goes
    through transformers' attention interface and cache, so the decode loop's attention function and cache plug in."""

    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, layer_idx, False
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.widths = [n * self.head_dim for n in (config.num_attention_heads, config.num_key_value_heads,
                                                   config.num_key_value_heads)]
        self.query_key_value = nn.Linear(config.hidden_size, sum(self.widths), bias=False)
        self.query_layernorm = Glm4MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.key_layernorm = Glm4MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.dense = nn.Linear(self.widths[0], config.hidden_size, bias=False)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        past_key_values = kv_cache_argument(past_key_values, kwargs)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query, key, value = (part.view(shape).transpose(1, 2)
                             for part in self.query_key_value(hidden_states).split(self.widths, dim=-1))
        cos, sin = position_embeddings
        query, key = apply_rotary_pos_emb(self.query_layernorm(query), self.key_layernorm(key), cos, sin)
        return self.dense(attend(self, query, key, value, attention_mask, past_key_values, **kwargs))


class LLaDA2MoeDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: LLaDA2MoeConfig, layer_idx: int):
        super().__init__()
        self.attention = LLaDA2MoeAttention(config, layer_idx)
        self.mlp = Glm4MoeMoE(config) if layer_idx >= config.first_k_dense_replace else Glm4MoeMLP(config)
        self.input_layernorm = Glm4MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Glm4MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_embeddings, **kwargs):
        hidden_states = hidden_states + self.attention(self.input_layernorm(hidden_states), position_embeddings,
                                                       **kwargs)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LLaDA2MoePreTrainedModel(ReleasedExperts, CompleteCheckpoint, Glm4MoePreTrainedModel):
    config_class = LLaDA2MoeConfig
    moe_layers = staticmethod(lambda config: list(range(config.first_k_dense_replace, config.num_hidden_layers)))
    _no_split_modules = ["LLaDA2MoeDecoderLayer"]
    _supports_flash_attn = False  # FlashAttention cannot express the block-causal staircase
    _can_record_outputs = {}


class LLaDA2MoeModel(LLaDA2MoePreTrainedModel):
    """The released decoder (`model.*`); its plain forward is block-causal over blocks of `config.block_size` from
    position 0."""

    def __init__(self, config: LLaDA2MoeConfig):
        super().__init__(config)
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LLaDA2MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Glm4MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.word_embeddings

    def set_input_embeddings(self, value):
        self.word_embeddings = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs) -> MoeModelOutputWithPast:
        past_key_values = kv_cache_argument(past_key_values, kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        if position_ids is None:
            start = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(start, start + inputs_embeds.shape[1], device=inputs_embeds.device)[None]
        if isinstance(attention_mask, dict):  # a prepared mask mapping, as stock decoders accept
            attention_mask = attention_mask["full_attention"]
        else:
            attention_mask = block_causal_mask(self.config, inputs_embeds, attention_mask, past_key_values,
                                               position_ids)
        rotary_dim = int(self.config.head_dim * self.config.partial_rotary_factor)
        cos, sin = rope_angles(position_ids, rotary_dim, self.config.rope_theta)
        position_embeddings = cos.to(inputs_embeds.dtype), sin.to(inputs_embeds.dtype)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings, attention_mask=attention_mask,
                                  position_ids=position_ids, past_key_values=past_key_values, **kwargs)
        return MoeModelOutputWithPast(last_hidden_state=self.norm(hidden_states),
                                       **cache_kwarg(past_key_values if use_cache else None))


class LLaDA2MoeModelLM(ReleasedExperts, CompleteCheckpoint, OwnDecoderLM, Glm4MoeForCausalLM):
    """GLM-4-MoE's causal-LM head and forward on `LLaDA2MoeModel`; loads the released checkpoints."""

    config_class = LLaDA2MoeConfig
    _no_split_modules = ["LLaDA2MoeDecoderLayer"]
    _supports_flash_attn = False
    _can_record_outputs = {}
    _tied_weights_keys = {"lm_head.weight": "model.word_embeddings.weight"}
    decoder_class = LLaDA2MoeModel
    moe_layers = LLaDA2MoePreTrainedModel.moe_layers


def register_checkpoint_conversion() -> None:
    """Give `llada2_moe` checkpoints the per-expert <-> fused-expert conversion of transformers' Qwen2-MoE family
    (which GLM-4-MoE uses) and the router-bias rename, in both directions. The registry in
    `transformers.conversion_mapping` is not a documented API (see `sdar_moe.register_expert_conversion`)."""
    from transformers import conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    conversion = list(conversion_mapping.get_checkpoint_conversion_mapping("qwen2_moe"))
    conversion.append(WeightRenaming(r"\.mlp\.gate\.expert_bias", ".mlp.gate.e_score_correction_bias"))
    conversion_mapping.register_checkpoint_conversion_mapping(LLaDA2MoeConfig.model_type, conversion, overwrite=True)
