"""Attention dispatch: one function registered with transformers' `AttentionInterface` under "hf_blockdiff".

While `generate_multi_block` runs, the model's `_attn_implementation` points here and every forward carries a
`ForwardPlan` (kwarg `blockdiff_plan`); the unmodified HF attention layers call us after `Cache.update`. Outside
generation the model's own implementation is untouched.
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from .cache import ForwardPlan
from .kernels import TRITON_AVAILABLE, flash
from .kernels.paged_attention import paged_attention
from .kernels.rmsnorm import rms_norm

ATTENTION_NAME = "hf_blockdiff"
HOW_TO_GET = {
    "triton": "install triton (`pip install triton`; CUDA builds of torch bundle it); on CPU it runs only under "
    "TRITON_INTERPRET=1, for testing",
    "flash_attn": "install FlashAttention (FA2: `pip install flash-attn --no-build-isolation`; FA3: build hopper/ of "
    "the flash-attention repository; FA4: `pip install flash-attn-4`); it runs on CUDA only",
}


def available_backends(device: torch.device) -> tuple[str, ...]:
    """Exact backends usable on `device`, slowest first."""
    backends = ["sdpa"]
    if device.type == "cuda" and flash.load() is not None:
        backends.append("flash_attn")
    if TRITON_AVAILABLE and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        backends.append("triton")
    return tuple(backends)


def resolve_backend(requested: str, device: torch.device, block_size: int, page_size: int) -> str:
    """The backend to run: `auto` picks the fastest exact one available (sdpa on CPU)."""
    available = available_backends(device)
    if requested == "auto":
        return available[-1] if device.type == "cuda" else "sdpa"
    if requested not in available:
        raise ValueError(
            f"attention_backend={requested!r} is not available on {device.type}: {HOW_TO_GET[requested]} "
            f"(available here: {', '.join(available)})."
        )
    if requested == "flash_attn":
        kernel = flash.load()
        if page_size % kernel.page_multiple:
            raise ValueError(f"page_size={page_size}: {kernel.name} reads pages of a multiple of "
                             f"{kernel.page_multiple} tokens; pass page_size={kernel.page_multiple}.")
        if block_size > 64 and block_size % 64:
            raise ValueError(f"block_size={block_size}: the flash_attn backend needs blocks of at most 64 tokens or a "
                             "multiple of 64 (one key length per 64-token chunk); use attention_backend='triton'.")
    return requested


@torch.compiler.disable
def blockdiff_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    blockdiff_plan: ForwardPlan | None = None,
    **kwargs,
):
    plan = blockdiff_plan
    if plan is None:
        raise RuntimeError("The hf_blockdiff attention runs only inside generate_multi_block.")
    if plan.backend == "triton":
        cache, layer = plan.cache, module.layer_idx
        out = paged_attention(query, cache.keys[layer], cache.values[layer], plan.page_table, plan.q_limit, scaling)
        return out, None
    if plan.backend == "flash_attn":
        out = flash.load().run(query.transpose(1, 2), plan.cache.keys[module.layer_idx],
                               plan.cache.values[module.layer_idx], plan.key_lengths, plan.page_table, scaling)
        return out, None
    mask = plan.dense_mask(key.shape[2])
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    AttentionInterface.register(ATTENTION_NAME, blockdiff_attention_forward)


# transformers' RMSNorm classes whose forward is exactly kernels.rmsnorm.rms_norm_reference
STOCK_RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Qwen3MoeRMSNorm")
FUSIONS = ("none", "norms", "compile")


def _fused_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated decoder layers: the ModuleList with one module per hidden layer."""
    count = model.config.get_text_config().num_hidden_layers
    return next((list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count), [])


@functools.cache
def compiled_forward(layer_type: type):
    """One torch.compile'd forward per decoder-layer class, shared by every layer of every model of that class.
    Shapes are dynamic, so windows of any size reuse it; the cache write and the attention run eagerly between the
    compiled pieces (both are `torch.compiler.disable`d), and the layer index is not specialized on."""
    return torch.compile(layer_type.forward, dynamic=True)


@contextmanager
def blockdiff_attention(model: torch.nn.Module, fusion: str = "none"):
    """Route the model's attention through hf_blockdiff for the duration of the block; with `fusion="norms"` its
    stock RMSNorms run as one Triton kernel each, with `fusion="compile"` its decoder layers run compiled (inductor
    fuses norms, rotary embedding and the gated MLP's activation). Everything is restored after."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    norms = [m for m in model.modules() if type(m).__name__ in STOCK_RMS_NORMS] if fusion == "norms" else []
    layers = decoder_layers(model) if fusion == "compile" else []
    for norm in norms:
        norm.forward = _fused_rms_norm_forward.__get__(norm)
    for layer in layers:
        layer.forward = compiled_forward(type(layer)).__get__(layer)
    try:
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True):
            yield
    finally:
        config._attn_implementation = previous
        for module in norms + layers:
            del module.forward
