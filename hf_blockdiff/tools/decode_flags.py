"""The decode settings `hf-blockdiff bench` and `hf-blockdiff warmup` share: their flags and the config they make.
A warmup thus compiles, and saves in its compile cache, the step's bookkeeping of the config that a bench with the
same flags decodes with: an artifact of the bookkeeping is keyed by its decode config (docs/kernels.md, "Kernels and
backends": compiled bookkeeping)."""

from __future__ import annotations

import argparse

from ..config import ATTENTION_BACKENDS, BlockDiffusionConfig
from ..config.profiles import model_profile
from ..generation.hf_conventions import as_given
from ..strategies import strategy_names
from .bench_models import LLADA2

COMPILE = {"auto": None, "on": True, "off": False}  # --compile -> BlockDiffusionConfig.compile


def add_decode_flags(parser) -> None:
    """How hf_blockdiff decodes (not how much: each command has its own --prompt-len and --new-tokens)."""
    parser.add_argument("--block-size", type=int, default=None,
                        help="block size (default: 4; LLaDA2: the preset's 32)")
    parser.add_argument("--steps-per-block", type=int, default=None,
                        help="decoding steps per block (default: the block size, one token per step)")
    parser.add_argument("--max-active-blocks", type=int, default=1,
                        help="blocks decoded at once; above 1 is multi-block decoding (default: %(default)s)")
    parser.add_argument("--block-add-threshold", type=float, default=1.0,
                        help="progress of the last block at which the next one is added (default: %(default)s)")
    parser.add_argument("--decoded-token-threshold", type=float, default=1.0, help="progress of a block's "
                        "predecessor at which the block must make progress (default: %(default)s)")
    parser.add_argument("--strategy", default=None,
                        help=f"strategy of hf_blockdiff: {', '.join(strategy_names())} (default: "
                        "low_confidence_static; bench's reference loop always commits the most confident positions on "
                        "its schedule; LLaDA2: the llada2 preset's rule, as diffusers)")
    parser.add_argument("--threshold", type=float, default=None,
                        help="τ of the threshold strategies (default: the strategy's own)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature of hf_blockdiff (default: %(default)s, greedy)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="with --temperature: sample from the k most likely tokens (default: %(default)s, all)")
    parser.add_argument("--editing-threshold", type=float, default=None,
                        help="LLaDA2 only: decode with the llada2_1 preset (editing) at this threshold, and diffusers "
                        "with the same (default: editing off, the llada2 preset)")
    parser.add_argument("--attention-backend", default="auto", help=f"attention kernels: "
                        f"{', '.join(ATTENTION_BACKENDS)} (default: %(default)s: Triton on CUDA, sdpa on CPU)")
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                        help="torch.compile the decoder layers and the step's bookkeeping: auto, on, off (default: "
                        "%(default)s, the config's compile=None)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="decode each row independently of its batch (RuntimeOptions.batch_invariant), to "
                        "measure what that costs (default: off)")


def block_flags_given(args) -> list[str]:
    """The decode flags given other than at their defaults that only block decoding reads (a canvas model's bench,
    DiffusionGemma's, decodes by its own rules and takes --attention-backend alone)."""
    parser = argparse.ArgumentParser()
    add_decode_flags(parser)
    defaults = vars(parser.parse_args([]))
    return [f"--{name.replace('_', '-')}" for name, default in defaults.items()
            if name != "attention_backend" and getattr(args, name) != default]


def mask_id(model) -> int:
    """The model's mask token (the last id where its profile names none)."""
    mask = model_profile(model).mask_token_id
    return model.config.get_text_config().vocab_size - 1 if mask is None else mask


def _llada2_config(args, mask: int) -> BlockDiffusionConfig:
    """The llada2 / llada2_1 preset under the flags' sizes (diffusers' LLaDA2Pipeline is bench's reference)."""
    if args.strategy or args.max_active_blocks != 1 or args.temperature or args.top_k:
        raise ValueError("LLaDA2 models are benchmarked with the llada2 preset against diffusers' LLaDA2Pipeline, "
                         "which has one rule, greedy: drop --strategy, --max-active-blocks, --temperature and "
                         "--top-k.")
    editing = {} if args.editing_threshold is None else {"editing_threshold": args.editing_threshold}
    sizes = {key: value for key, value in (("block_size", args.block_size), ("steps_per_block", args.steps_per_block),
                                           ("threshold", args.threshold)) if value is not None}
    return as_given(BlockDiffusionConfig.from_preset(
        "llada2_1" if editing else "llada2", mask_token_id=mask, max_new_tokens=args.new_tokens, eos_token_id=[],
        attention_backend=args.attention_backend, compile=COMPILE[args.compile], batch_invariant=args.batch_invariant,
        **editing, **sizes))


def decode_config(args, model) -> BlockDiffusionConfig:
    """The config the flags give for the model: every token decoded (no stop ids), bidirectional models aligned to the
    prompt's end."""
    if model.config.model_type == LLADA2:
        return _llada2_config(args, mask_id(model))
    if args.editing_threshold is not None:
        raise ValueError("--editing-threshold needs a LLaDA2 model (--shape llada2-mini): the reference loops of the "
                         "other families do not edit.")
    if args.top_k > 0 and not args.temperature > 0:
        raise ValueError(f"--top-k {args.top_k} filters sampled proposals, and greedy decoding samples none: give "
                         "--temperature above 0 too, or drop --top-k.")
    bidirectional = model_profile(model).attention == "bidirectional"
    block_size = args.block_size or 4
    return as_given(BlockDiffusionConfig(
        mask_token_id=mask_id(model), block_size=block_size, steps_per_block=args.steps_per_block or block_size,
        max_new_tokens=args.new_tokens, strategy=args.strategy or "low_confidence_static", threshold=args.threshold,
        temperature=args.temperature, top_k=args.top_k,
        max_active_blocks=args.max_active_blocks, block_add_threshold=args.block_add_threshold,
        decoded_token_threshold=args.decoded_token_threshold, eos_token_id=[], attention_backend=args.attention_backend,
        attention="bidirectional" if bidirectional else "block_causal",
        alignment="prompt_end" if bidirectional else "absolute",
        compile=COMPILE[args.compile], batch_invariant=args.batch_invariant,
    ))
