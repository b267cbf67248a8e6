"""Tiny random checkpoints in the released on-disk format of each family: the released `config.json` keys (SDAR: the
real file, sizes shrunk; the others: the keys of their released configs), the released tensor names (written out
here by hand, not taken from our classes), safetensors, and the remote-code `auto_map` that loading must ignore."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "reference"  # released SDAR files (no weights)
SDAR_4B = REFERENCE / "SDAR-4B-Chat"
SDAR_8B = REFERENCE / "SDAR-8B-Chat"

# sizes shared by the tiny models; token ids inside the tiny vocabulary
QWEN_SIZES = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=96, max_position_embeddings=64, max_window_layers=2,
                  bos_token_id=93, eos_token_id=94, torch_dtype="float32")
QWEN2_KEYS = dict(attention_dropout=0.0, hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6,
                  rope_scaling=None, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False,
                  transformers_version="4.46.2", use_cache=False, use_sliding_window=False)


def sdar_config():
    config = json.loads((SDAR_4B / "config.json").read_text())
    return {**config, **QWEN_SIZES, "head_dim": 8, "mask_token_id": 95, "block_size": 4}


def sdar_moe_config():
    config = {key: value for key, value in sdar_config().items() if key != "intermediate_size"}
    return {**config, "architectures": ["SDARMoeForCausalLM"], "model_type": "sdar_moe",
            "auto_map": {"AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
                         "AutoModel": "modeling_sdar_moe.SDARMoeModel",
                         "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM"},
            "decoder_sparse_step": 1, "intermediate_size": 48, "mlp_only_layers": [], "moe_intermediate_size": 16,
            "norm_topk_prob": True, "num_experts": 4, "num_experts_per_tok": 2, "output_router_logits": False,
            "router_aux_loss_coef": 0.001}


def dream_config():
    return {**QWEN2_KEYS, **QWEN_SIZES, "architectures": ["DreamModel"], "model_type": "Dream",
            "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
            "mask_token_id": 95, "pad_token_id": 93}


def fast_dllm_config(**overrides):
    return {**QWEN2_KEYS, **QWEN_SIZES, "architectures": ["Fast_dLLM_QwenForCausalLM"], "model_type": "Fast_dLLM_Qwen",
            "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig",
                         "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
            "bd_size": 4, **overrides}


def llada_config(**overrides):
    config = {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 32,
        "embedding_dropout": 0.0, "embedding_size": 96, "eos_token_id": 94, "flash_attention": False,
        "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "meta",
        "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
        "layer_norm_with_affine": True, "mask_token_id": 95, "max_sequence_length": 64, "mlp_hidden_size": 48,
        "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None, "n_heads": 4, "n_kv_heads": 4,
        "n_layers": 2, "pad_token_id": 94, "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-5,
        "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False,
        "transformers_version": "4.46.3", "use_cache": False, "vocab_size": 96, "weight_tying": False,
    }
    return {**config, **overrides}


def llada2_config(**overrides):
    """LLaDA2.0-mini's released config keys, tiny sizes (3 layers: dense, MoE, MoE; 8 experts in 4 groups)."""
    return {
        "architectures": ["LLaDA2MoeModelLM"], "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "embedding_dropout": 0.0, "first_k_dense_replace": 1, "head_dim": 8, "hidden_act": "silu",
        "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48, "max_position_embeddings": 512,
        "max_window_layers": 3, "model_type": "llada2_moe", "moe_intermediate_size": 16,
        "moe_router_enable_expert_bias": True, "n_group": 4, "norm_head": False, "norm_softmax": False,
        "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "num_hidden_layers": 3, "num_key_value_heads": 2, "num_shared_experts": 1, "output_dropout": 0.0,
        "output_router_logits": False, "pad_token_id": 92, "eos_token_id": 94, "partial_rotary_factor": 0.5,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 600000, "rotary_dim": 4,
        "routed_scaling_factor": 2.5, "router_dtype": "fp32", "score_function": "sigmoid",
        "tie_word_embeddings": False, "topk_group": 2, "torch_dtype": "float32", "transformers_version": "4.52.3",
        "use_bias": False, "use_cache": False, "use_qk_norm": True, "use_qkv_bias": False,
        "using_split_qkv_in_self_attention": False, "vocab_size": 96, "block_size": 4, **overrides,
    }


def _shapes_llada2(cfg):
    hidden, head_dim = cfg["hidden_size"], cfg["head_dim"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * head_dim
    shapes = {"model.word_embeddings.weight": (cfg["vocab_size"], hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (cfg["vocab_size"], hidden)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (hidden,), f"{p}.post_attention_layernorm.weight": (hidden,),
                       f"{p}.attention.query_key_value.weight": (qkv, hidden),
                       f"{p}.attention.query_layernorm.weight": (head_dim,),
                       f"{p}.attention.key_layernorm.weight": (head_dim,),
                       f"{p}.attention.dense.weight": (hidden, cfg["num_attention_heads"] * head_dim)})
        moe = i >= cfg["first_k_dense_replace"]
        mlps = {f"{p}.mlp": cfg["intermediate_size"]} if not moe else {
            **{f"{p}.mlp.experts.{e}": cfg["moe_intermediate_size"] for e in range(cfg["num_experts"])},
            f"{p}.mlp.shared_experts": cfg["moe_intermediate_size"] * cfg["num_shared_experts"]}
        for mlp, width in mlps.items():
            shapes.update({f"{mlp}.gate_proj.weight": (width, hidden), f"{mlp}.up_proj.weight": (width, hidden),
                           f"{mlp}.down_proj.weight": (hidden, width)})
        if moe:
            shapes.update({f"{p}.mlp.gate.weight": (cfg["num_experts"], hidden),
                           f"{p}.mlp.gate.expert_bias": (cfg["num_experts"],)})
    return shapes


def _shapes_qwen(cfg):
    hidden, head_dim = cfg["hidden_size"], cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    q_width, kv_width = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    qwen2 = "head_dim" not in cfg  # Qwen2: q/k/v biases; Qwen3: q/k norms
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], hidden)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes.update({f"{p}.input_layernorm.weight": (hidden,), f"{p}.post_attention_layernorm.weight": (hidden,)})
        for name, shape in {"q": (q_width, hidden), "k": (kv_width, hidden), "v": (kv_width, hidden),
                            "o": (hidden, q_width)}.items():
            shapes[f"{p}.self_attn.{name}_proj.weight"] = shape
        if qwen2:
            shapes.update({f"{p}.self_attn.{n}_proj.bias": (w,) for n, w in zip("qkv", (q_width, kv_width, kv_width))})
        else:
            shapes.update({f"{p}.self_attn.q_norm.weight": (head_dim,), f"{p}.self_attn.k_norm.weight": (head_dim,)})
        experts = [f"{p}.mlp.experts.{e}" for e in range(cfg.get("num_experts", 0))]
        width = cfg["moe_intermediate_size"] if experts else cfg["intermediate_size"]
        for mlp in experts or [f"{p}.mlp"]:
            shapes.update({f"{mlp}.gate_proj.weight": (width, hidden), f"{mlp}.up_proj.weight": (width, hidden),
                           f"{mlp}.down_proj.weight": (hidden, width)})
        if experts:
            shapes[f"{p}.mlp.gate.weight"] = (len(experts), hidden)
    return shapes


def _shapes_llada(cfg):
    d, head_dim, hidden = cfg["d_model"], cfg["d_model"] // cfg["n_heads"], cfg["mlp_hidden_size"]
    kv_width = cfg["n_kv_heads"] * head_dim
    shapes = {"model.transformer.wte.weight": (cfg["embedding_size"], d), "model.transformer.ln_f.weight": (d,)}
    if not cfg["weight_tying"]:
        shapes["model.transformer.ff_out.weight"] = (cfg["embedding_size"], d)
    if cfg["include_bias"] and not cfg["weight_tying"]:
        shapes["model.transformer.ff_out.bias"] = (cfg["embedding_size"],)
    for i in range(cfg["n_layers"]):
        p = f"model.transformer.blocks.{i}"
        linears = {"q_proj": (d, d), "k_proj": (kv_width, d), "v_proj": (kv_width, d), "attn_out": (d, d),
                   "ff_proj": (hidden, d), "up_proj": (hidden, d), "ff_out": (d, hidden)}
        shapes.update({f"{p}.attn_norm.weight": (d,), f"{p}.ff_norm.weight": (d,)})
        for name, shape in linears.items():
            shapes[f"{p}.{name}.weight"] = shape
            if cfg["include_bias"] or (cfg["include_qkv_bias"] and name in ("q_proj", "k_proj", "v_proj")):
                shapes[f"{p}.{name}.bias"] = shape[:1]
    return shapes


def random_state(config, seed=0):
    """Random float32 weights under the released names; norm weights near 1."""
    shapes = {"llada": _shapes_llada, "llada2_moe": _shapes_llada2}.get(config["model_type"], _shapes_qwen)(config)
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in sorted(shapes.items()):
        is_norm = "norm" in name or "ln_f" in name
        scale = 0.1 if is_norm or "expert_bias" in name else 0.3
        state[name] = torch.randn(shape, generator=generator) * scale + (1.0 if is_norm else 0.0)
    return state


def sharp_state(config, seed=0):
    """`random_state` with the non-norm weights tripled: sharper logits, so confidence thresholds fire."""
    state = random_state(config, seed)
    return {name: tensor if "norm" in name or "ln_f" in name else tensor * 3 for name, tensor in state.items()}


def write_checkpoint(directory: Path, config: dict, state: dict) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
