"""The bench's models: random weights in the sizes of released checkpoints (nothing is downloaded) or a checkpoint,
optionally quantized weight-only or sharded with transformers' tp_plan (`hf-blockdiff bench`, tools/bench.py)."""

from __future__ import annotations

import os

import torch

from ..integrations.distributed import launch_size

SHAPES = {  # architecture sizes of released checkpoints (random weights; nothing is downloaded)
    "tiny": dict(model_type="sdar", hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=32, vocab_size=4096),
    "sdar-1.7b": dict(model_type="sdar", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "sdar-4b": dict(model_type="sdar", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "sdar-8b": dict(model_type="sdar", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "llada-8b": dict(model_type="llada", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, mlp_hidden_size=12288,
                     vocab_size=126464, embedding_size=126464, rope_theta=500000.0, max_sequence_length=8192),
    "llada2-mini": dict(model_type="llada2_moe"),  # the config's defaults are LLaDA2.0-mini's (16B-A1B)
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


def build_model(shape: str, model_path: str | None, device: str, dtype: torch.dtype, quantization: str = "none",
                tensor_parallel: bool = False):
    """A checkpoint, or random weights of `shape`; quantized weight-only as transformers' quantizers do it (torchao
    int8/fp8 applied to the built model; bitsandbytes nf4 quantizes while loading, so it needs `model_path`);
    `tensor_parallel`: sharded over the launch's processes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if tensor_parallel:
        return _tensor_parallel_model(shape, model_path, device, dtype, quantization)
    quantized = _quantization_config(quantization)
    if model_path:
        extra = {} if quantized is None else {"quantization_config": quantized, "device_map": device}
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **extra)
        return (model if quantized is not None else model.to(device)).eval()
    if quantization == "nf4":
        raise ValueError("--quantization nf4: bitsandbytes quantizes while loading a checkpoint: pass --model DIR.")
    sizes = dict(SHAPES[shape])
    model_type = sizes.pop("model_type")
    if model_type == "sdar":
        sizes["max_position_embeddings"] = 32768
    if model_type != LLADA2:  # LLaDA2's mask id is its profile's, not a config key
        sizes["mask_token_id"] = sizes["vocab_size"] - 1
    config = AutoConfig.for_model(model_type, **sizes)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if quantized is not None:
        from torchao.quantization import quantize_

        quantize_(model, quantized.quant_type, filter_fn=lambda module, name: isinstance(module, torch.nn.Linear)
                  and "lm_head" not in name)
        model.config.quantization_config = quantized  # what a checkpoint loaded with it would carry
    return model.eval()


def _tensor_parallel_model(shape: str, model_path: str | None, device: str, dtype: torch.dtype, quantization: str):
    """The model sharded with transformers' tp_plan="auto" over every process of the torchrun launch. Random weights
    are built whole with the same seed on every process (replicated parameters must agree), moved to the CPU, and
    sharded from that state dict (so the whole copy leaves the GPU)."""
    from transformers import DistributedConfig

    if quantization != "none":
        raise ValueError("--tensor-parallel shards unquantized weights: drop --quantization.")
    if launch_size() < 2:
        raise ValueError("--tensor-parallel shards over the processes of a launch: run the bench under "
                         "`torchrun --nproc_per_node N -m hf_blockdiff.cli bench ...` (N dividing the head counts)")
    if device.startswith("cuda"):  # each process decodes on its own GPU, as transformers binds it
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    distributed = DistributedConfig(tp_plan="auto", tp_size=launch_size())
    if model_path:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, distributed_config=distributed).eval()
    torch.manual_seed(0)
    whole = build_model(shape, None, device, dtype)
    state, config, kind = {k: v.cpu() for k, v in whole.state_dict().items()}, whole.config, type(whole)
    del whole
    return kind.from_pretrained(None, config=config, state_dict=state, dtype=dtype,
                                distributed_config=distributed).eval()
