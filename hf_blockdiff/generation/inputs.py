"""A call's prompts and arguments, checked before any forward (docs/architecture.md, "Errors"): at least one row, left
padding, ids inside the vocabulary, lengths that fit the model; a torch.Generator, a streamer with `put` and `end`,
and a compiler for `compile=True` on the call's device. Without an `attention_mask`, leading pad ids are padding, as
transformers' `generate` infers its mask, unless the pad id is also a stop id or the mask id (then it cannot tell: it
warns once)."""

from __future__ import annotations

import torch
from transformers.utils import logging

from ..attention import AttentionBackend, resolve_backend
from ..config import BlockDiffusionConfig
from ..config.checks import fail
from ..fusion.invariant import check_batch_invariant
from ..kernels import TRITON_AVAILABLE
from ..weights.quantization import check_quantization
from ..weights.tensor_parallel import check_tensor_parallel
from .engine import plan_shapes

logger = logging.get_logger(__name__)


def prompts_of(input_ids: torch.Tensor, attention_mask, cfg: BlockDiffusionConfig,
               vocab_size: int | None) -> list[torch.Tensor]:
    """Each row's prompt without its left padding."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError("input_ids must be a LongTensor of shape [batch, prompt_length] (tokenizer(..., "
                         "return_tensors='pt').input_ids).")
    if input_ids.shape[0] == 0:  # transformers' generate fails on an empty batch too (a shape error in its forward)
        raise ValueError(f"input_ids has shape {list(input_ids.shape)}: no prompt to decode; pass at least one row "
                         "(an empty list of prompts needs no call).")
    if attention_mask is None:
        attention_mask = _inferred_mask(input_ids, cfg)
    if not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask is a {type(attention_mask).__name__}: pass a torch.Tensor of shape "
                         f"{tuple(input_ids.shape)} (tokenizer(..., return_tensors='pt').attention_mask), or None.")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; input_ids has {tuple(input_ids.shape)}.")
    mask = attention_mask.bool().to(input_ids.device)
    if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
        raise ValueError(
            "attention_mask is right-padded (or has holes): generate_multi_block needs left padding. "
            "Set tokenizer.padding_side = 'left'."
        )
    _check_vocabulary(input_ids, mask, vocab_size)
    lengths = mask.sum(-1).tolist()
    return [row[len(row) - n :] for row, n in zip(input_ids, lengths)]


def _inferred_mask(input_ids: torch.Tensor, cfg: BlockDiffusionConfig) -> torch.Tensor:
    pad = cfg.pad_token_id
    leading = (input_ids == pad).long().cumprod(-1).bool()  # the run of pad ids each row starts with
    if not bool(leading.any()):
        return torch.ones_like(input_ids, dtype=torch.bool)
    if pad in cfg.stop_ids or pad == cfg.mask_token_id:
        logger.warning_once(
            f"input_ids start with the pad id {pad}, which is also a stop or mask id, and no attention_mask was "
            "given: those positions are decoded as prompt. Pass the tokenizer's attention_mask for a left-padded batch."
        )
        return torch.ones_like(input_ids, dtype=torch.bool)
    return ~leading


def _check_vocabulary(input_ids: torch.Tensor, mask: torch.Tensor, vocab_size: int | None) -> None:
    if vocab_size is None:
        return
    outside = mask & ((input_ids < 0) | (input_ids >= vocab_size))
    if bool(outside.any()):
        row, position = (int(i) for i in outside.nonzero()[0])
        raise ValueError(
            f"input_ids[{row}, {position}] = {int(input_ids[row, position])} is outside the model's vocabulary "
            f"[0, {vocab_size}): encode the prompts with the model's own tokenizer."
        )


def check_lengths(model, prompts: list[torch.Tensor], cfg: BlockDiffusionConfig) -> None:
    if any(len(p) == 0 for p in prompts):
        raise ValueError("Every row needs at least one prompt token (a row of attention_mask is all zeros).")
    limit = getattr(model.config, "max_position_embeddings", None)
    longest, _ = plan_shapes([len(p) for p in prompts], cfg)
    if limit is not None and longest > limit:
        raise ValueError(
            f"The longest prompt plus max_new_tokens={cfg.max_new_tokens} (rounded up to whole blocks: {longest} "
            f"positions) exceeds the model's max_position_embeddings={limit}: lower max_new_tokens or shorten the prompt."
        )


def decoding_backend(model, cfg: BlockDiffusionConfig, device: torch.device) -> AttentionBackend:
    """The attention backend `model` decodes `cfg` with on `device`, after the model checks every call and live
    engine makes: its quantized weights, its tensor-parallel layout, and what batch-invariant decoding covers."""
    check_quantization(model)
    check_tensor_parallel(model)
    backend = resolve_backend(cfg.runtime.attention_backend, device, cfg.block_size, cfg.runtime.page_size,
                              cfg.runtime.batch_invariant)
    check_batch_invariant(model, backend)
    return backend


def check_call(cfg: BlockDiffusionConfig, device: torch.device, generator, streamer) -> None:
    """The call's arguments beside the prompts: `generator` a torch.Generator (or None), `streamer` a transformers
    streamer (or None), and `compile=True` a compiler for inductor on `device`."""
    if generator is not None and not isinstance(generator, torch.Generator):
        seed = generator if isinstance(generator, int) and not isinstance(generator, bool) else 0
        raise TypeError(f"generator={generator!r} ({type(generator).__name__}) is no torch.Generator: pass one, e.g. "
                        f"torch.Generator().manual_seed({seed}), or None for torch's default generator.")
    missing = [name for name in ("put", "end") if not callable(getattr(streamer, name, None))]
    if streamer is not None and missing:
        raise TypeError(f"streamer ({type(streamer).__name__}) has no {' and no '.join(missing)} method: pass a "
                        "transformers streamer (a BaseStreamer such as TextStreamer) or an object with put(token_ids) "
                        "and end() methods.")
    if cfg.runtime.compile:
        _check_compiler(device)


def _check_compiler(device: torch.device) -> None:
    """torch.compile's inductor generates Triton kernels on CUDA and C++ on the CPU (the Triton kernels of
    hf_blockdiff are then left out: `fusion.decoding_mode`)."""
    if device.type == "cuda" and not TRITON_AVAILABLE:
        fail("compile", True, "torch.compile needs Triton on CUDA: install triton (`pip install triton`), or pass "
             "compile=None")
    if device.type == "cpu":
        from torch._inductor import cpp_builder, exc

        try:
            cpp_builder.get_cpp_compiler()
        except exc.InvalidCxxCompiler:
            fail("compile", True, "torch.compile on the CPU needs a C++ compiler and none was found: install g++ (or "
                 "set CXX to one), or pass compile=None")
