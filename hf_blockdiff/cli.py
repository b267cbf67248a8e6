"""`hf-blockdiff` command line: generate (and the subcommands registered by other modules).

`accelerate launch -m hf_blockdiff.cli generate ...` (or `torchrun`) splits the prompts over the processes and writes
the results in input order from the main process; with `--tensor-parallel` under `torchrun` the processes share
the model's weights instead."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .config import BlockDiffusionConfig
from .integrations.checkpoint import DTYPES, load_pretrained
from .integrations.distributed import generate_distributed, process_state
from .tools import bench, demo

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
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{args.input}:{number}: not a JSON object ({error.msg})") from None
        if not isinstance(record, dict) or not ("prompt" in record or "messages" in record):
            raise ValueError(f"{args.input}:{number}: each line needs a 'prompt' string or a 'messages' list")
        prompts.append(record.get("messages", record.get("prompt")))
    return prompts


def run_generate(args: argparse.Namespace) -> None:
    cfg = config_from_args(args)
    prompts = read_prompts(args)
    model, tokenizer = load_pretrained(args.model, args.device, args.dtype, args.tensor_parallel)
    results = generate_distributed(model, prompts, cfg, tokenizer, batch_size=args.batch_size, chat=args.chat,
                                   progress=True)
    if not process_state().is_main_process:
        return
    lines = [
        json.dumps({"prompt": p, "completion": c.text, "num_forwards": c.num_forwards}, ensure_ascii=False)
        for p, c in zip(prompts, results)
    ]
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n")
    elif args.prompt is not None:
        print(results[0].text)
    else:
        print("\n".join(lines))


def run_lm_eval(args: argparse.Namespace) -> None:
    try:
        from .integrations.lm_eval import run_cli
    except ImportError as error:
        raise ValueError(f"lm-eval is not installed ({error}): pip install lm-eval") from None
    run_cli(args.passed_on)


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
    gen.add_argument("--device", help="default: this process's device (cuda:LOCAL_RANK under accelerate/torchrun)")
    gen.add_argument("--dtype", default="float32", choices=DTYPES)
    gen.add_argument("--tensor-parallel", action="store_true",
                     help="shard the model over the processes of a torchrun launch (tp_plan='auto')")
    add_config_flags(gen)
    gen.set_defaults(run=run_generate)
    bench.add_parser(commands)
    demo.add_parsers(commands)
    evaluate = commands.add_parser("lm-eval", add_help=False, help="lm-evaluation-harness with the hf-blockdiff "
                                   "model registered; lm_eval's arguments follow (needs `pip install lm-eval`)")
    evaluate.set_defaults(run=run_lm_eval)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, passed_on = parser.parse_known_args(argv)
    if args.command == "lm-eval":  # every argument is lm_eval's
        args.passed_on = passed_on
    elif passed_on:
        parser.error(f"unrecognized arguments: {' '.join(passed_on)}")
    try:
        args.run(args)
    except (ValueError, TypeError, OSError) as error:
        print("hf-blockdiff: error:", " ".join(str(error).split()), file=sys.stderr)  # one line, however long
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
