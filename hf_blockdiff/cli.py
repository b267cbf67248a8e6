"""`hf-blockdiff` command line: generate (and the subcommands registered by other modules)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from . import bench
from .config import BlockDiffusionConfig

# BlockDiffusionConfig fields exposed as flags, with their parser
CONFIG_FLAGS = {
    "mask_token_id": int, "block_size": int, "steps_per_block": int, "max_new_tokens": int, "strategy": str,
    "threshold": float, "fallback": str, "temperature": float, "top_k": int, "top_p": float,
    "max_active_blocks": int, "block_add_threshold": float, "decoded_token_threshold": float, "alignment": str,
    "attention": str, "pad_token_id": int, "attention_backend": str, "page_size": int,
}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("decoding (BlockDiffusionConfig fields; unset ones come from the model)")
    for name, kind in CONFIG_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None)
    group.add_argument("--eos-token-id", dest="eos_token_id", type=int, nargs="*", default=None)
    group.add_argument("--logit-shift", dest="logit_shift", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--early-stop", dest="early_stop", action=argparse.BooleanOptionalAction, default=None)
    group.add_argument("--fused-store", dest="fused_store", action=argparse.BooleanOptionalAction, default=None)


def config_from_args(args: argparse.Namespace, **defaults) -> BlockDiffusionConfig:
    names = {f.name for f in dataclasses.fields(BlockDiffusionConfig)}
    values = {**defaults, **{k: v for k, v in vars(args).items() if k in names and v is not None}}
    return BlockDiffusionConfig(**values)


def read_prompts(args: argparse.Namespace) -> list:
    if args.prompt is not None:
        return [args.prompt]
    prompts = []
    for number, line in enumerate(Path(args.input).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        if not isinstance(record, dict) or not ("prompt" in record or "messages" in record):
            raise ValueError(f"{args.input}:{number}: each line needs a 'prompt' string or a 'messages' list")
        prompts.append(record.get("messages", record.get("prompt")))
    return prompts


def load(path: str, device: str, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import hf_blockdiff  # noqa: F401  (registers model types)

    if not Path(path).is_dir():
        raise ValueError(f"--model {path!r} is not a directory holding a checkpoint (config.json, weights, tokenizer)")
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    return model, tokenizer


def encode(tokenizer, prompts: list, chat: bool):
    if chat:
        texts = [
            tokenizer.apply_chat_template(
                p if isinstance(p, list) else [{"role": "user", "content": p}], tokenize=False,
                add_generation_prompt=True,
            )
            for p in prompts
        ]
    else:
        if any(isinstance(p, list) for p in prompts):
            raise ValueError("'messages' records need --chat")
        texts = prompts
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not chat)


def generate_texts(model, tokenizer, prompts: list, cfg: BlockDiffusionConfig, chat: bool, batch_size: int,
                   progress: bool = True):
    """Completions of `prompts` in order, with the forward count of each batch."""
    from tqdm.auto import tqdm

    results = []
    batches = range(0, len(prompts), batch_size)
    for start in tqdm(batches, disable=not progress or len(batches) < 2, desc="generate"):
        chunk = prompts[start : start + batch_size]
        enc = encode(tokenizer, chunk, chat).to(model.device)
        out = model.generate_multi_block(enc.input_ids, cfg, attention_mask=enc.attention_mask, return_dict=True)
        width = enc.input_ids.shape[1]
        for row in range(len(chunk)):
            text = tokenizer.decode(out.sequences[row, width:], skip_special_tokens=True)
            results.append({"completion": text, "num_forwards": out.num_forwards})
    return results


def run_generate(args: argparse.Namespace) -> None:
    model, tokenizer = load(args.model, args.device, args.dtype)
    prompts = read_prompts(args)
    cfg = config_from_args(args)
    results = generate_texts(model, tokenizer, prompts, cfg, args.chat, args.batch_size)
    lines = [json.dumps({"prompt": p, **r}, ensure_ascii=False) for p, r in zip(prompts, results)]
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")
    elif args.prompt is not None:
        print(results[0]["completion"])
    else:
        print("\n".join(lines))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-blockdiff", description="Block-diffusion decoding inside transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("--model", required=True, help="checkpoint directory")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt")
    source.add_argument("--input", help="JSONL file: one {'prompt': ...} or {'messages': [...]} per line")
    gen.add_argument("--output", help="write JSONL results here instead of printing")
    gen.add_argument("--chat", action="store_true", help="format prompts with the tokenizer's chat template")
    gen.add_argument("--batch-size", type=int, default=16)
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    add_config_flags(gen)
    gen.set_defaults(run=run_generate)
    bench.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ValueError, TypeError, OSError, json.JSONDecodeError) as error:
        print(f"hf-blockdiff: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
