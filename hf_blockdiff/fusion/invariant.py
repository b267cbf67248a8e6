"""The models batch-invariant decoding cannot cover (`RuntimeOptions.batch_invariant`; docs/architecture.md,
"Batch-invariant decoding"), refused before any forward.

On the invariant kernels every decoder layer runs its fused forward (`fusion/layers.py`) uncompiled, each projection
in the skinny GEMM's invariant launch, the norms as Triton kernels, attention in one key split, and the LM head in the
invariant launch too (`generation/executor.py`). That covers a model only when every decoder layer has a fused
forward and the final norm and the LM head are stock: dense Qwen2/Qwen3-style layers with plain weights.
"""

from __future__ import annotations

import torch

from ..attention import AttentionBackend
from ..weights.tensor_parallel import tensor_parallel_size
from .layers import plain_linear
from .mode import STOCK_RMS_NORMS, decoder_layers, fully_fused


def check_batch_invariant(model: torch.nn.Module, backend: AttentionBackend) -> None:
    """A ValueError naming batch_invariant and why, for a model the invariant kernels do not cover (a backend
    decodes on them when `backend.batch_invariant`: `attention.resolve_backend`)."""
    if not backend.batch_invariant:
        return
    problem = _uncovered(model)
    if problem:
        raise ValueError(f"BlockDiffusionConfig.runtime.batch_invariant=True cannot make this model's rows "
                         f"independent of their batch: {problem}. Pass batch_invariant=False.")


def _uncovered(model: torch.nn.Module) -> str | None:
    """What of the model would still reduce in an order that follows the batch (None: nothing)."""
    if tensor_parallel_size(model) > 1:
        return ("a tensor-parallel model sums its shards by a kernel chosen by message size (ours, torch's two-shot "
                "or NCCL)")
    if not fully_fused(model):
        kinds = ", ".join(sorted({type(layer).__name__ for layer in decoder_layers(model)}))
        return (f"not every decoder layer ({kinds}) has a fused forward: only stock Qwen2/Qwen3 decoder layers with "
                "a gated MLP and plain weights do (no MoE experts, quantized, LoRA-wrapped or hooked modules)")
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    norm = getattr(decoder, "norm", None)
    if type(norm).__name__ not in STOCK_RMS_NORMS:
        return f"its final norm ({type(norm).__name__}) is not a stock RMSNorm"
    head = model.get_output_embeddings()
    if head is None or not plain_linear(head, model.dtype):
        return f"its LM head ({type(head).__name__}) is not a plain nn.Linear in {model.dtype}"
    return None
