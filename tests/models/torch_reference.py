"""Plain-torch forwards of the released architectures, written from their published descriptions and independent of
transformers and of hf_blockdiff: what the library's classes must reproduce. They read weights by their released
checkpoint names and compute in float32.

A KV cache filled by an earlier forward is emulated without one: `record` collects every layer's keys and values of a
forward, and `stale=(recorded, fresh)` makes a later forward of the same length attend, at the positions not marked
`fresh`, to the recorded keys and values instead of its own (what a cache holding them gives)."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, positions, theta):
    """Rotate-half RoPE on [batch, heads, seq, head_dim] with integer positions [seq] or [batch, seq]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angles = (positions.double()[..., None] * inv_freq).float()
    cos, sin = torch.cat((angles.cos(),) * 2, dim=-1), torch.cat((angles.sin(),) * 2, dim=-1)
    if positions.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def attention(q, k, v, allowed):
    """Softmax attention; `allowed` [batch, q, k] bool; a query that may see no key gets zeros. GQA by repeating
    K/V heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return scores.softmax(-1).nan_to_num(0.0) @ v


def _cached(layer, k, v, stale, record):
    """This layer's keys and values: recorded into `record`, and taken from `stale`'s recording where not fresh."""
    if record is not None:
        record.append((k, v))
    if stale is None:
        return k, v
    recorded, fresh = stale
    old_k, old_v = recorded[layer]
    return torch.where(fresh[:, None], k, old_k), torch.where(fresh[:, None], v, old_v)


def block_causal(length, block_size):
    index = torch.arange(length)
    return (index[None, :] // block_size) <= (index[:, None] // block_size)


def key_padding(attention_mask):
    """Bidirectional pattern with padded keys removed: [batch, q, k]."""
    return attention_mask.bool()[:, None, :].expand(-1, attention_mask.shape[1], -1)


def _linear(state, name, x):
    return F.linear(x, state[f"{name}.weight"], state.get(f"{name}.bias"))


def _split_heads(x, head_dim):
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


def _swiglu(state, gate, up, down, x):
    return _linear(state, down, F.silu(_linear(state, gate, x)) * _linear(state, up, x))


def _moe(state, prefix, x, cfg):
    """Qwen3-MoE routing: softmax over experts, top-k, renormalized when `norm_topk_prob`."""
    probs = F.linear(x, state[f"{prefix}.gate.weight"]).softmax(-1)
    weights, experts = probs.topk(cfg["num_experts_per_tok"], dim=-1)
    if cfg["norm_topk_prob"]:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(cfg["num_experts"]):
        name = f"{prefix}.experts.{e}"
        expert_out = _swiglu(state, f"{name}.gate_proj", f"{name}.up_proj", f"{name}.down_proj", x)
        out += (weights * (experts == e)).sum(-1, keepdim=True) * expert_out
    return out


def qwen_logits(state, cfg, ids, allowed, positions=None, stale=None, record=None):
    """Qwen2 (q/k/v biases when present), Qwen3 (q/k RMSNorm per head when present) and Qwen3-MoE decoders."""
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    eps = cfg["rms_norm_eps"]
    positions = torch.arange(ids.shape[1]) if positions is None else positions
    x = state["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = rms_norm(x, state[f"{p}.input_layernorm.weight"], eps)
        q, k, v = (_split_heads(_linear(state, f"{p}.self_attn.{n}_proj", h), head_dim) for n in "qkv")
        if f"{p}.self_attn.q_norm.weight" in state:
            q = rms_norm(q, state[f"{p}.self_attn.q_norm.weight"], eps)
            k = rms_norm(k, state[f"{p}.self_attn.k_norm.weight"], eps)
        q, k = rope(q, positions, cfg["rope_theta"]), rope(k, positions, cfg["rope_theta"])
        k, v = _cached(i, k, v, stale, record)
        out = attention(q, k, v, allowed).transpose(1, 2).flatten(2)
        x = x + _linear(state, f"{p}.self_attn.o_proj", out)
        h = rms_norm(x, state[f"{p}.post_attention_layernorm.weight"], eps)
        if f"{p}.mlp.gate.weight" in state:
            x = x + _moe(state, f"{p}.mlp", h, cfg)
        else:
            x = x + _swiglu(state, f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj", f"{p}.mlp.down_proj", h)
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    return F.linear(rms_norm(x, state["model.norm.weight"], eps), head)


def llada_logits(state, cfg, ids, allowed, stale=None, record=None):
    """LLaDA's `LLaDALlamaBlock` stack: pre-RMSNorm, RoPE from position 0, SwiGLU with `ff_proj` as the gate."""
    head_dim, eps = cfg["d_model"] // cfg["n_heads"], cfg["rms_norm_eps"]
    positions = torch.arange(ids.shape[1])
    x = state["model.transformer.wte.weight"][ids]
    for i in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{i}"
        h = rms_norm(x, state[f"{p}.attn_norm.weight"], eps)
        q, k, v = (_split_heads(_linear(state, f"{p}.{n}_proj", h), head_dim) for n in "qkv")
        q, k = rope(q, positions, cfg["rope_theta"]), rope(k, positions, cfg["rope_theta"])
        k, v = _cached(i, k, v, stale, record)
        x = x + _linear(state, f"{p}.attn_out", attention(q, k, v, allowed).transpose(1, 2).flatten(2))
        h = rms_norm(x, state[f"{p}.ff_norm.weight"], eps)
        x = x + _swiglu(state, f"{p}.ff_proj", f"{p}.up_proj", f"{p}.ff_out", h)
    x = rms_norm(x, state["model.transformer.ln_f.weight"], eps)
    if cfg["weight_tying"]:
        return F.linear(x, state["model.transformer.wte.weight"])
    return _linear(state, "model.transformer.ff_out", x)


def _llada2_moe(state, prefix, x, cfg):
    """LLaDA2 routing: sigmoid scores; choose among the `topk_group` groups with the largest top-2 sums of
    score + expert_bias, the top-k of score + bias; weights = the chosen scores renormalized, times the scaling."""
    scores = F.linear(x, state[f"{prefix}.gate.weight"]).sigmoid()
    biased = scores + state[f"{prefix}.gate.expert_bias"]
    grouped = biased.view(*biased.shape[:-1], cfg["n_group"], -1)
    groups = grouped.topk(2, dim=-1).values.sum(-1).topk(cfg["topk_group"], dim=-1).indices
    allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter(-1, groups, True)
    biased = biased.masked_fill(~allowed.repeat_interleave(grouped.shape[-1], dim=-1), float("-inf"))
    experts = biased.topk(cfg["num_experts_per_tok"], dim=-1).indices
    weights = scores.gather(-1, experts)
    weights = weights / weights.sum(-1, keepdim=True) * cfg["routed_scaling_factor"]
    out = _swiglu(state, f"{prefix}.shared_experts.gate_proj", f"{prefix}.shared_experts.up_proj",
                  f"{prefix}.shared_experts.down_proj", x)
    for e in range(cfg["num_experts"]):
        name = f"{prefix}.experts.{e}"
        expert_out = _swiglu(state, f"{name}.gate_proj", f"{name}.up_proj", f"{name}.down_proj", x)
        out = out + (weights * (experts == e)).sum(-1, keepdim=True) * expert_out
    return out


def llada2_logits(state, cfg, ids, allowed):
    """LLaDA2-MoE: fused q/k/v, per-head q/k RMSNorm, RoPE on the first `partial_rotary_factor` of each head."""
    head_dim, eps = cfg["head_dim"], cfg["rms_norm_eps"]
    rotary = int(head_dim * cfg["partial_rotary_factor"])
    positions = torch.arange(ids.shape[1])
    heads = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_key_value_heads"])
    x = state["model.word_embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = rms_norm(x, state[f"{p}.input_layernorm.weight"], eps)
        qkv = _linear(state, f"{p}.attention.query_key_value", h).split([n * head_dim for n in heads], dim=-1)
        q, k, v = (_split_heads(part, head_dim) for part in qkv)
        q = rms_norm(q, state[f"{p}.attention.query_layernorm.weight"], eps)
        k = rms_norm(k, state[f"{p}.attention.key_layernorm.weight"], eps)
        q, k = (torch.cat((rope(t[..., :rotary], positions, cfg["rope_theta"]), t[..., rotary:]), -1) for t in (q, k))
        x = x + _linear(state, f"{p}.attention.dense", attention(q, k, v, allowed).transpose(1, 2).flatten(2))
        h = rms_norm(x, state[f"{p}.post_attention_layernorm.weight"], eps)
        if i >= cfg["first_k_dense_replace"]:
            x = x + _llada2_moe(state, f"{p}.mlp", h, cfg)
        else:
            x = x + _swiglu(state, f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj", f"{p}.mlp.down_proj", h)
    return F.linear(rms_norm(x, state["model.norm.weight"], eps), state["lm_head.weight"])
