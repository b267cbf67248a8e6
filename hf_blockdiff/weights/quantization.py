"""Models loaded with transformers' quantization on the fast path (docs/architecture.md, "Around the loop").

torchao weights (int8 / fp8 weight-only: tensor subclasses that torch.compile and CUDA graphs trace) run the fast
path; its int8 weight-only tensors run slower compiled than eager (measured on an H200, docs/benchmarks.md, "Weight-only
quantization"), so compiling the decoder layers is off by default for them, with one log line. bitsandbytes 4-bit
layers call bitsandbytes' own kernels, which neither torch.compile nor graph capture is known to take: those two
are turned off for such a model, with one log line saying so. Other methods
are refused before any forward. LoRA pre-merge refuses quantized base weights (merging into them cannot be undone
bit-exactly).
"""

from __future__ import annotations

from transformers.utils import logging

logger = logging.get_logger(__name__)

FAST_PATH_METHODS = ("torchao", "bitsandbytes")
# torchao weight types whose decoder layers decode slower compiled than eager inside CUDA graphs (SDAR-4B shapes on
# an H200, 2026-11-23, hf-blockdiff bench: batch 1 at 9.7 tok/s compiled against 64.5 uncompiled)
SLOW_COMPILED_WEIGHTS = ("Int8Tensor",)


def quantization_method(model) -> str | None:
    """transformers' `quant_method` of the model's quantization config (None: not quantized)."""
    config = getattr(model.config, "quantization_config", None)
    if config is None:
        return None
    method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
    return str(getattr(method, "value", method))


def check_quantization(model) -> None:
    method = quantization_method(model)
    if method is not None and method not in FAST_PATH_METHODS:
        raise ValueError(f"The model is quantized with {method!r}, which generate_multi_block does not run: load it "
                         f"unquantized, or quantized with {' or '.join(FAST_PATH_METHODS)} (transformers' "
                         "TorchAoConfig / BitsAndBytesConfig).")


def traceable(model) -> bool:
    """Whether torch.compile and CUDA graphs may run the model's layers (False logs, once, what is turned off)."""
    if quantization_method(model) != "bitsandbytes":
        return True
    logger.warning_once("bitsandbytes-quantized weights: CUDA graphs and torch.compile of the decoder layers are "
                        "turned off for this model (its kernels are not known to be capturable).")
    return False


def compiles_well(model) -> bool:
    """Whether compiling the decoder layers is on by default for the model's weights (False logs, once, why not)."""
    if not traceable(model):
        return False
    slow = sorted({type(p).__name__ for p in model.parameters()} & set(SLOW_COMPILED_WEIGHTS))
    if slow:
        logger.warning_once(f"torchao {', '.join(slow)} weights: torch.compile of the decoder layers is off by "
                            "default (slower than eager for these weights); pass BlockDiffusionConfig(compile=True) "
                            "to force it.")
        return False
    return True


def is_quantized_weight(weight) -> bool:
    """A weight held by a quantization library's tensor type (torchao subclasses, bitsandbytes parameters)."""
    return type(weight).__module__.split(".")[0] in ("torchao", "bitsandbytes")
