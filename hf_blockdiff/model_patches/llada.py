"""LLaDA (GSAI-ML, `model_type: llada`): a Llama-style transformer with bidirectional attention, in its released
config keys and weight names.

What the released `modeling_llada.py` computes (block_type "llama", the only layout of the released checkpoints):
`x += attn_out(attn(rope(q_proj(n)), rope(k_proj(n)), v_proj(n)))` with `n = attn_norm(x)`, then
`x += ff_out(silu(ff_proj(n)) * up_proj(n))` with `n = ff_norm(x)`; logits `transformer.ff_out(ln_f(x))`. Norms are
RMSNorm computed in float32 (Llama's), RoPE is applied in float32 (`rope_full_precision`) with positions counted from
0, and attention is never causal (`is_causal=False`, only the padding mask). Our modules are named like the released
ones, so checkpoints and LoRA adapters trained on the remote code load unchanged and `save_pretrained` writes the
released names with no conversion step; the attention goes through transformers' attention interface and cache like
stock Llama, so the decode loop's attention function and cache plug in.

Released call forms: LLaDA's `generate.py` loads the model with `AutoModel` (its `auto_map` names the LM there) and
calls `model(x, attention_mask=padding).logits`; Fast-dLLM v1's `generate.py` adds `use_cache=True`, cache tuples
sliced to a prefix and passed back, and `replace_position` for its dual cache (`released/calls.py`).
"""

from __future__ import annotations

import torch
from huggingface_hub.dataclasses import strict
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from .attention import attend, bidirectional_mask, forward_mask
from ..cache.keyword import CACHE_KEYWORD, cache_kwarg, kv_cache_argument
from ..config.profiles import ModelProfile
from .released.checkpoint import CompleteCheckpoint, ReleasedConfig
from .released.calls import dual_cache_call

PROFILE = ModelProfile(
    mask_token_id=126336, attention="bidirectional", alignment="prompt_end", logit_shift=False, block_size=32,
    eos_token_id=(126081, 126348),  # <|endoftext|>, <|eot_id|>; block 32: the block_length of LLaDA's generate demo
)


_FIXED_OPTIONS = {
    "block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "layer_norm_with_affine": True,
    "rope": True, "rope_full_precision": True, "alibi": False, "attention_layer_norm": False, "block_group_size": 1,
    "scale_logits": False, "input_emb_norm": False,
}


@strict
class LLaDAConfig(ReleasedConfig, PreTrainedConfig):
    """The released LLaDA config keys, with the standard transformers names mapped onto them."""

    model_type = "llada"
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "num_key_value_heads": "n_kv_heads",
        "intermediate_size": "mlp_hidden_size",
        "max_position_embeddings": "max_sequence_length",
        "tie_word_embeddings": "weight_tying",
        "initializer_range": "init_std",
    }

    # defaults: LLaDA-8B
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = 32
    mlp_hidden_size: int | None = 12288
    mlp_ratio: int = 4
    vocab_size: int = 126464
    embedding_size: int | None = 126464
    max_sequence_length: int = 4096
    rope_theta: float | int = 500000.0
    rms_norm_eps: float = 1e-5
    weight_tying: bool = False
    include_bias: bool = False
    include_qkv_bias: bool | None = False
    bias_for_layer_norm: bool | None = False
    attention_dropout: float = 0.0
    init_std: float = 0.02
    use_cache: bool = False
    mask_token_id: int | None = 126336
    eos_token_id: int | None = 126081
    pad_token_id: int | None = 126081
    multi_query_attention: bool | None = None
    # options of the remote code of which we implement one value, that of the released checkpoints
    block_type: str = "llama"
    activation_type: str = "silu"
    layer_norm_type: str = "rms"
    layer_norm_with_affine: bool = True
    rope: bool = True
    rope_full_precision: bool = True
    alibi: bool = False
    attention_layer_norm: bool = False
    block_group_size: int = 1
    scale_logits: bool = False
    input_emb_norm: bool = False

    def __post_init__(self, **kwargs):
        if self.n_kv_heads is None:  # the remote code's `effective_n_kv_heads`
            self.n_kv_heads = 1 if self.multi_query_attention else self.n_heads
        if self.mlp_hidden_size is None:
            self.mlp_hidden_size = self.mlp_ratio * self.d_model
        if self.embedding_size is None:
            self.embedding_size = self.vocab_size
        self._check_layout()
        super().__post_init__(**kwargs)

    def _check_layout(self):
        for key, value in _FIXED_OPTIONS.items():
            if getattr(self, key) != value:
                raise ValueError(f"LLaDA config `{key}={getattr(self, key)!r}` is not supported (only {value!r}).")
        norm_bias = self.include_bias if self.bias_for_layer_norm is None else self.bias_for_layer_norm
        if norm_bias:
            raise ValueError("LLaDA configs with layer-norm biases (`bias_for_layer_norm`) are not supported.")


def rope_angles(position_ids: torch.LongTensor, dim: int, theta: float):
    """float32 rotate-half (cos, sin) of shape [batch, seq, dim] for `position_ids`: inverse frequencies
    `theta^(-2i/dim)` (the `default` RoPE of transformers and of the released remote codes)."""
    exponents = torch.arange(0, dim, 2, device=position_ids.device, dtype=torch.float32) / dim
    freqs = position_ids[:, :, None].float() * (1.0 / theta**exponents)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def llada_rope(config: LLaDAConfig, position_ids: torch.LongTensor):
    """float32 (cos, sin) of shape [batch, 1, seq, head_dim] for `position_ids`, as the remote code computes them."""
    cos, sin = rope_angles(position_ids, config.d_model // config.n_heads, config.rope_theta)
    return cos[:, None], sin[:, None]


def apply_rope_fp32(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE applied in float32 and cast back (Llama applies it in the activation dtype)."""
    x = states.float()
    first, second = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-second, first), dim=-1) * sin).to(states.dtype)


class LLaDABlock(GradientCheckpointingLayer):
    """One released `LLaDALlamaBlock`: parameter names as in the checkpoint; it is also the attention module handed
    to the attention interface (it carries `is_causal`, `scaling`, `num_key_value_groups`, `layer_idx`)."""

    def __init__(self, config: LLaDAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = False
        self.head_dim = config.d_model // config.n_heads
        self.num_key_value_groups = config.n_heads // config.n_kv_heads
        self.scaling = self.head_dim**-0.5
        width, kv_width, hidden = config.d_model, config.n_kv_heads * self.head_dim, config.mlp_hidden_size
        qkv_bias = config.include_bias or bool(config.include_qkv_bias)
        self.attn_norm = LlamaRMSNorm(width, eps=config.rms_norm_eps)
        self.q_proj = nn.Linear(width, width, bias=qkv_bias)
        self.k_proj = nn.Linear(width, kv_width, bias=qkv_bias)
        self.v_proj = nn.Linear(width, kv_width, bias=qkv_bias)
        self.attn_out = nn.Linear(width, width, bias=config.include_bias)
        self.ff_norm = LlamaRMSNorm(width, eps=config.rms_norm_eps)
        self.ff_proj = nn.Linear(width, hidden, bias=config.include_bias)  # gate
        self.up_proj = nn.Linear(width, hidden, bias=config.include_bias)
        self.ff_out = nn.Linear(hidden, width, bias=config.include_bias)  # down

    def forward(self, hidden_states, position_embeddings, attention_mask=None, past_key_values=None, **kwargs):
        past_key_values = kv_cache_argument(past_key_values, kwargs)
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        normed = self.attn_norm(hidden_states)
        cos, sin = position_embeddings
        query = apply_rope_fp32(self.q_proj(normed).view(shape).transpose(1, 2), cos, sin)
        key = apply_rope_fp32(self.k_proj(normed).view(shape).transpose(1, 2), cos, sin)
        value = self.v_proj(normed).view(shape).transpose(1, 2)
        attended = attend(self, query, key, value, attention_mask, past_key_values, **kwargs)
        hidden_states = hidden_states + self.attn_out(attended)
        normed = self.ff_norm(hidden_states)
        return hidden_states + self.ff_out(F.silu(self.ff_proj(normed)) * self.up_proj(normed))


class LLaDAPreTrainedModel(CompleteCheckpoint, PreTrainedModel):
    config_class = LLaDAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LLaDABlock"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True


class LLaDAModel(LLaDAPreTrainedModel):
    """`model.transformer` of the released checkpoint. Its `ff_out` (the LM head, absent with `weight_tying`) lives
    here to keep the released names; only `LLaDAModelLM` uses it."""

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.embedding_size, config.d_model),
            "blocks": nn.ModuleList(LLaDABlock(config, i) for i in range(config.n_layers)),
            "ln_f": LlamaRMSNorm(config.d_model, eps=config.rms_norm_eps),
        })
        if not config.weight_tying:
            self.transformer["ff_out"] = nn.Linear(config.d_model, config.embedding_size, bias=config.include_bias)
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, **kwargs) -> BaseModelOutputWithPast:
        past_key_values = kv_cache_argument(past_key_values, kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of `input_ids` and `inputs_embeds`.")
        if inputs_embeds is None:
            inputs_embeds = self.transformer.wte(input_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        query_length = inputs_embeds.shape[1]
        call = dual_cache_call(self.config, past_key_values, use_cache, query_length, kwargs)
        cache = call.layers_cache
        if position_ids is None:
            position_ids = call.position_ids(query_length, inputs_embeds.device)
        attention_mask = forward_mask(bidirectional_mask, self.config, inputs_embeds, attention_mask, cache,
                                      position_ids)
        if isinstance(attention_mask, dict):  # a prepared mask mapping, as stock decoders accept
            attention_mask = attention_mask["full_attention"]
        position_embeddings = llada_rope(self.config, position_ids)
        hidden_states = inputs_embeds
        for block in self.transformer.blocks:
            hidden_states = block(
                hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                position_ids=position_ids, past_key_values=cache, **kwargs,
            )
        return call.finish(BaseModelOutputWithPast(
            last_hidden_state=self.transformer.ln_f(hidden_states), **cache_kwarg(cache if use_cache else None),
        ))


class LLaDAModelLM(LLaDAPreTrainedModel):
    """LLaDA with its LM head (`model.transformer.ff_out`, or the input embedding with `weight_tying`). Its plain
    forward is bidirectional, like the remote code's."""

    def __init__(self, config: LLaDAConfig):
        super().__init__(config)
        self.model = LLaDAModel(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def get_output_embeddings(self):
        transformer = self.model.transformer
        return transformer.wte if self.config.weight_tying else transformer.ff_out

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs) -> CausalLMOutputWithPast:
        past_key_values = kv_cache_argument(past_key_values, kwargs)
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
        )
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        head = self.get_output_embeddings()
        logits = F.linear(outputs.last_hidden_state[:, keep], head.weight, getattr(head, "bias", None))
        loss = None
        if labels is not None:  # transformers' causal-LM loss, as the stock classes compute it
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **cache_kwarg(getattr(outputs, CACHE_KEYWORD)))
