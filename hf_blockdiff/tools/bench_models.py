"""The bench's models: random weights in the sizes of released checkpoints (nothing is downloaded) or a checkpoint,
optionally quantized weight-only or sharded with transformers' tp_plan (`hf-blockdiff bench`, tools/bench.py)."""

from __future__ import annotations

import argparse

import torch

from ..integrations.distributed import build_sharded, load_sharded

QWEN3 = dict(head_dim=128, rope_theta=1_000_000.0, tie_word_embeddings=False)  # every SDAR config below
QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, rope_theta=1_000_000.0, tie_word_embeddings=False)
# Architecture sizes of released checkpoints (random weights; nothing is downloaded), with where each came from. Mask
# ids are the released ones (a config key, or the family profile's where the config has none: model_patches/). A
# config key left out takes its config class's default (model_patches/ for our families).
SHAPES = {
    "tiny": dict(model_type="sdar", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=4096,
                 max_position_embeddings=32768),
    # SDAR-1.7B-Chat: trained from Qwen3-1.7B-Base (JetAstra/SDAR README.md); Qwen3-1.7B's sizes, SDAR-4B/8B's
    # untied embeddings, context and mask id
    "sdar-1.7b": dict(model_type="sdar", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, vocab_size=151936, max_position_embeddings=32768,
                      mask_token_id=151669, **QWEN3),
    # SDAR-4B-Chat, SDAR-8B-Chat: their released config.json (/work/shared/reference/checkpoints/, copied to
    # tests/fixtures/reference/). TraDo-8B-Instruct is SDAR-8B trained further with TraceRL (Gen-Verse/dLLM-RL
    # README.md: the same mask id 151669 and block 4); its config.json was not found in a source we could read, so
    # it is taken to be SDAR-8B's and has no shape of its own.
    "sdar-4b": dict(model_type="sdar", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=151936, max_position_embeddings=32768,
                    mask_token_id=151669, **QWEN3),
    "sdar-8b": dict(model_type="sdar", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=151936, max_position_embeddings=32768,
                    mask_token_id=151669, **QWEN3),
    # SDAR-30B-A3B-Chat: trained from Qwen3-30B-A3B-Base (JetAstra/SDAR README.md); Qwen3-30B-A3B's sizes (48
    # layers, 32/4 heads of 128, 128 experts of 768, top 8, every layer MoE), SDAR's context and mask id
    "sdar-30b-a3b": dict(model_type="sdar_moe", hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                         num_attention_heads=32, num_key_value_heads=4, vocab_size=151936, num_experts=128,
                         num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                         max_position_embeddings=32768, mask_token_id=151669, **QWEN3),
    # LLaDA-8B-Instruct: /work/shared/DESIGN.md section 6; context as our LLaDAConfig's LLaDA-8B defaults
    "llada-8b": dict(model_type="llada", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288,
                     vocab_size=126464, embedding_size=126464, rope_theta=500000.0, max_sequence_length=4096,
                     mask_token_id=126336),
    # LLaDA2.0-mini (16B-A1B): our LLaDA2MoeConfig's defaults are its config.json (20 layers, 16/4 heads of 128, 256
    # experts of 512 in 8 groups, top 8, 1 shared, first layer dense; inclusionAI/LLaDA2.1-mini's config.json has the
    # same sizes); mask id 156895 from the profile
    "llada2-mini": dict(model_type="llada2_moe"),
    # LLaDA2.0-flash (100B-A6B, continued from Ling-flash-2.0): the config.json inclusionAI ships for it in dFactory
    # (github.com/inclusionAI/dFactory, configs/model_configs/llada2_flash/config.json; the Hub's own config.json was
    # not found in a source we could read): 32 layers of 4096, 32/4 heads of 128, the first layer dense (9216), then
    # 256 experts of 1024 in 8 groups, top 4 groups, top 8, 1 shared; vocabulary 157184, context 16384. Everything
    # else (rope 600000 on half of each head, sigmoid routing scaled 2.5, untied embeddings) is LLaDA2.0-mini's, our
    # defaults. About 103B parameters: 206 GB in bf16, 105 GB per GPU over 2 (the attention is kept whole).
    "llada2-flash": dict(model_type="llada2_moe", hidden_size=4096, intermediate_size=9216, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=256,
                         num_experts_per_tok=8, n_group=8, topk_group=4, moe_intermediate_size=1024,
                         num_shared_experts=1, first_k_dense_replace=1, vocab_size=157184,
                         max_position_embeddings=16384),
    # Dream-v0-Instruct-7B: Qwen2.5-7B's sizes (/work/shared/DESIGN.md section 6; apple/DiffuCoder-7B-Instruct, a
    # Dream model, has the same config.json), mask id 151666
    "dream-7b": dict(model_type="Dream", max_position_embeddings=131072, mask_token_id=151666, **QWEN25_7B),
    # Fast_dLLM_v2_7B: its config.json (huggingface.co/Efficient-Large-Model/Fast_dLLM_v2_7B, Qwen2.5-7B sizes,
    # bd_size 32, context 32768); mask id 151665 from the profile
    "fast-dllm-v2-7b": dict(model_type="Fast_dLLM_Qwen", bd_size=32, max_position_embeddings=32768,
                            mask_token_id=151665, **QWEN25_7B),
    "diffusion-gemma-26b-a4b": dict(model_type="diffusion_gemma"),  # sizes in tools/diffusion_gemma_bench.py
    "diffusion-gemma-tiny": dict(model_type="diffusion_gemma"),
    "llada2-tiny": dict(model_type="llada2_moe", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, n_group=4,
                        topk_group=2, num_experts_per_tok=2, moe_intermediate_size=32),
}
LLADA2 = "llada2_moe"


def _quantization_config(quantization: str):
    """transformers' quantization config for --quantization (None: none)."""
    from transformers import BitsAndBytesConfig, TorchAoConfig

    if quantization == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    if quantization in ("int8", "fp8"):
        from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

        return TorchAoConfig(Int8WeightOnlyConfig() if quantization == "int8" else Float8WeightOnlyConfig())
    return None


def shape_config(shape: str, layers: int | None = None):
    """The transformers config of `shape` (not DiffusionGemma's: tools/diffusion_gemma_bench.py), keeping its first
    `layers` layers (None: all). Shapes without a mask id take the last id of the vocabulary (LLaDA2's is its
    profile's, not a config key)."""
    from transformers import AutoConfig

    sizes = dict(SHAPES[shape])
    model_type = sizes.pop("model_type")
    if model_type != LLADA2:
        sizes.setdefault("mask_token_id", sizes["vocab_size"] - 1)
    if layers is not None:
        sizes["num_hidden_layers"] = layers  # every family maps the standard name onto its own (LLaDA: n_layers)
    return AutoConfig.for_model(model_type, **sizes)


def build_model(shape: str, model_path: str | None, device: str, dtype: torch.dtype, quantization: str = "none",
                tensor_parallel: int = 0, layers: int | None = None, expert_parallel: bool = False):
    """A checkpoint, or random weights of `shape` (its first `layers` layers; None: all; seeded, the same in every
    process) built on `device`; quantized weight-only as transformers' quantizers do it (torchao int8/fp8 applied to
    the built model; bitsandbytes nf4 quantizes while loading, so it needs `model_path`); `tensor_parallel`: sharded
    over groups of that many of the launch's processes, `expert_parallel` its experts by expert."""
    from transformers import AutoModelForCausalLM

    if tensor_parallel:
        return _tensor_parallel_model(shape, model_path, device, dtype, quantization, layers, tensor_parallel,
                                      expert_parallel)
    quantized = _quantization_config(quantization)
    if model_path:
        extra = {} if quantized is None else {"quantization_config": quantized, "device_map": device}
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **extra)
        return (model if quantized is not None else model.to(device)).eval()
    if quantization == "nf4":
        raise ValueError("--quantization nf4: bitsandbytes quantizes while loading a checkpoint: pass --model DIR.")
    config = shape_config(shape, layers)
    target = torch.device(device)
    cuda = [target.index if target.index is not None else torch.cuda.current_device()] if target.type == "cuda" else []
    with torch.device(device), torch.random.fork_rng(devices=cuda):  # seeded weights; the caller's RNG untouched
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if quantized is not None:
        from torchao.quantization import quantize_

        quantize_(model, quantized.quant_type, filter_fn=lambda module, name: isinstance(module, torch.nn.Linear)
                  and "lm_head" not in name)
        model.config.quantization_config = quantized  # what a checkpoint loaded with it would carry
    return model.eval()


def _tensor_parallel_model(shape: str, model_path: str | None, device: str, dtype: torch.dtype, quantization: str,
                           layers: int | None, size: int, expert_parallel: bool = False):
    """The model sharded with transformers' tp_plan="auto" over groups of `size` processes of the torchrun launch
    (one group: all of them), on `device`'s type (integrations.distributed: cuda:LOCAL_RANK over NCCL, or the CPU
    over gloo); `expert_parallel`: the experts split whole over the group. A checkpoint: each process reads its shards
    (`load_sharded`); random weights: each process initializes only its shards, where they live, with the same seed
    (`build_sharded`). No process ever holds the whole model."""
    if quantization != "none":
        raise ValueError("--tensor-parallel shards unquantized weights: drop --quantization.")
    if model_path:
        from transformers import AutoModelForCausalLM

        return load_sharded(AutoModelForCausalLM, model_path, size, device, expert_parallel, dtype=dtype).eval()
    return build_sharded(shape_config(shape, layers), size, device, dtype, expert_parallel=expert_parallel).eval()


def prompt_ceiling(model) -> int:
    """Random prompt ids are drawn below this: under the vocabulary, the mask id and the multimodal placeholders
    (DiffusionGemma refuses an image token in a text prompt)."""
    text, names = model.config.get_text_config(), ("image_token_id", "boi_token_id", "eoi_token_id", "audio_token_id")
    ids = [text.vocab_size, getattr(text, "mask_token_id", None)] + [getattr(model.config, n, None) for n in names]
    return min(i for i in ids if isinstance(i, int)) - 1


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """A command-line list of batch sizes, "1,32,128"."""
    try:
        sizes = tuple(int(value) for value in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: pass positive batch sizes, comma-separated (e.g. 1,32,128)")
    return sizes
