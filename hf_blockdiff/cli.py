"""`hf-blockdiff` command line: generate (and the subcommands registered by other modules).

`accelerate launch -m hf_blockdiff.cli generate ...` (or `torchrun`) splits the prompts over the processes and writes
the results in input order from the main process; with `--tensor-parallel-size N` under `torchrun` groups of N
processes share the model's weights and the prompts are split over the groups (`--expert-parallel`: a MoE model's
experts split whole over each group)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from .assets import BUNDLED_MODELS, model_path
from .config import ATTENTION_BACKENDS, FALLBACKS, BlockDiffusionConfig, RuntimeOptions
from .integrations.checkpoint import DTYPES, check_device, load_pretrained
from .integrations.completions import encode
from .integrations.distributed import generate_distributed, is_main_process
from .config.checks import decoded_block_size
from .config.presets import PRESETS
from .config.profiles import ALIGNMENTS, ATTENTIONS, model_profile
from .strategies import strategy_names
from .tools import bench, demo, warmup

# flags of BlockDiffusionConfig's fields and of its runtime options (keywords of the config too)
DEFAULTS = {f.name: f.default for cls in (BlockDiffusionConfig, RuntimeOptions) for f in dataclasses.fields(cls)}
FROM_MODEL = "(default: the model's)"
# as `generate`: a generation_config with do_sample=True decides the sampling flags left unset
FROM_GENERATION_CONFIG = "(default: the model's generation_config where it samples, else {})"
# BlockDiffusionConfig fields exposed as flags: parser and help; a field whose default is not None gets
# "(default: ...)" appended, the others say in their help what decides them
CONFIG_FLAGS = {
    "mask_token_id": (int, f"id written at undecided positions {FROM_MODEL}"),
    "block_size": (int, f"positions decoded together {FROM_MODEL}"),
    "steps_per_block": (int, "decoding steps per block of the scheduled strategies (default: the block size)"),
    "max_new_tokens": (int, f"tokens generated per prompt (default: {DEFAULTS['max_new_tokens']}, or fewer where "
                            "the model's max_position_embeddings cannot hold that many after the longest prompt: "
                            "then as many whole blocks as fit)"),
    "strategy": (str, f"which positions each step commits: {', '.join(strategy_names())}"),
    "threshold": (float, "τ of the threshold strategies (default: the strategy's own)"),
    "fallback": (str, f"what low_confidence_dynamic commits when too few positions pass the threshold: "
                      f"{', '.join(FALLBACKS)}"),
    "temperature": (float, f"0 decodes greedily, above 0 samples {FROM_GENERATION_CONFIG}"),
    "top_k": (int, f"sample among the k most likely tokens; 0 or less is off {FROM_GENERATION_CONFIG}"),
    "top_p": (float, f"nucleus sampling, a probability in (0, 1]; 1 is off {FROM_GENERATION_CONFIG}"),
    "max_active_blocks": (int, "blocks decoded at once; above 1 is multi-block decoding"),
    "block_add_threshold": (float, "progress of the last block at which the next one is added (multi-block)"),
    "decoded_token_threshold": (float, "progress of a block's predecessor at which the block must make progress "
                                       "(multi-block)"),
    "alignment": (str, f"where blocks start: {', '.join(ALIGNMENTS)} {FROM_MODEL}"),
    "attention": (str, f"attention rule of the model: {', '.join(ATTENTIONS)} {FROM_MODEL}"),
    "pad_token_id": (int, f"id written after the first stop token {FROM_MODEL}"),
    "attention_backend": (str, f"attention kernels: {', '.join(ATTENTION_BACKENDS)} (auto: Triton on CUDA, sdpa "
                               "on CPU)"),
    "page_size": (int, "tokens per KV-cache page, a power of two"),
}


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("decoding (BlockDiffusionConfig fields; unset ones come from the model)")
    for name, (kind, text) in CONFIG_FLAGS.items():
        default = DEFAULTS[name]
        text = text.format(default) if "{}" in text else text
        text = text if default is None or "(default:" in text else f"{text} (default: {default})"
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None, help=text)
    group.add_argument("--preset", dest="preset", default=None, metavar="NAME",
                       help=f"reproduce a reference decoder: {', '.join(PRESETS)}; the other flags override its "
                       "fields (default: none)")
    group.add_argument("--eos-token-id", dest="eos_token_id", type=int, nargs="*", default=None,
                       help=f"stop token ids; the flag with no ids never stops early {FROM_MODEL}")
    group.add_argument("--logit-shift", dest="logit_shift", action=argparse.BooleanOptionalAction, default=None,
                       help=f"token i is predicted at position i-1 {FROM_MODEL}")
    group.add_argument("--early-stop", dest="early_stop", action=argparse.BooleanOptionalAction, default=None,
                       help="end a prompt once the block holding its first stop token is complete (default: on)")
    group.add_argument("--fused-store", dest="fused_store", action=argparse.BooleanOptionalAction, default=None,
                       help="store a finished block's K/V in the next block's first forward (default: on)")


def config_from_args(args: argparse.Namespace) -> BlockDiffusionConfig:
    """The flags' config: with --preset, the preset's fields under the flags given (an unknown name: ValueError)."""
    fields = {k: v for k, v in vars(args).items() if k in DEFAULTS and v is not None}
    preset = fields.pop("preset", None)
    return BlockDiffusionConfig.from_preset(preset, **fields) if preset else BlockDiffusionConfig(**fields)


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


def fitting_max_new_tokens(model, cfg: BlockDiffusionConfig, longest_prompt: int) -> int:
    """max_new_tokens when the flag is not given: the config's default, lowered to the whole blocks that the model's
    max_position_embeddings hold after the longest prompt (a note on stderr says so)."""
    limit = getattr(model.config, "max_position_embeddings", None)
    default = DEFAULTS["max_new_tokens"]
    block = decoded_block_size(cfg, model_profile(model)) or 1  # none: one block over all
    if limit is None or longest_prompt + default <= limit // block * block:
        return default
    room = (limit // block * block - longest_prompt) // block * block
    if room <= 0:
        raise ValueError(f"the longest prompt has {longest_prompt} tokens: the model's max_position_embeddings="
                         f"{limit} leave no room for a block of {block} new tokens; shorten the prompt")
    if is_main_process():
        print(f"hf-blockdiff: note: --max-new-tokens not given: generating {room} tokens, the whole blocks of "
              f"{block} that the model's {limit} positions hold after the longest prompt ({longest_prompt} tokens)",
              file=sys.stderr)
    return room


def run_generate(args: argparse.Namespace) -> None:
    if args.device is not None:
        check_device(args.device, "--device")
    cfg = config_from_args(args)
    prompts = read_prompts(args)
    model, tokenizer = load_pretrained(model_path(args.model), args.device, args.dtype, args.tensor_parallel_size,
                                       args.expert_parallel)
    encoded = [encode(p, tokenizer, args.chat) for p in prompts]
    if args.max_new_tokens is None:
        longest = max((len(ids) for ids in encoded), default=0)
        cfg = cfg.replace(max_new_tokens=fitting_max_new_tokens(model, cfg, longest))
    results = generate_distributed(model, encoded, cfg, tokenizer, batch_size=args.batch_size, progress=True)
    if not is_main_process():
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


def add_generate_parser(commands) -> None:
    gen = commands.add_parser("generate", help="generate completions for prompts")
    gen.add_argument("--model", required=True,
                     help=f"checkpoint directory, or a bundled model ({', '.join(BUNDLED_MODELS)}) (required)")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt (no default: give --prompt or --input)")
    source.add_argument("--input", help="JSONL file: one {'prompt': ...} or {'messages': [...]} per line (no "
                        "default: give --prompt or --input)")
    gen.add_argument("--output", help="write JSONL results to this file (default: print them)")
    gen.add_argument("--chat", action="store_true",
                     help="format prompts with the tokenizer's chat template (default: off)")
    gen.add_argument("--batch-size", type=int, default=16, help="prompts decoded together (default: %(default)s)")
    gen.add_argument("--device", help="default: this process's device (cuda:LOCAL_RANK under accelerate/torchrun, "
                     "else the GPU if there is one, else cpu)")
    gen.add_argument("--dtype", default="float32", choices=DTYPES,
                     help=f"dtype of the weights: {', '.join(DTYPES)} (default: %(default)s)")
    gen.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                     help="shard the model over groups of N processes of a torchrun launch of N·M processes "
                     "(tp_plan='auto'); the prompts are split over the M groups (default: %(default)s, no sharding)")
    gen.add_argument("--expert-parallel", action="store_true",
                     help="with --tensor-parallel-size N, a MoE model's experts split whole over the N processes "
                     "(num_experts / N each), attention still tensor parallel (default: off)")
    add_config_flags(gen)
    gen.set_defaults(run=run_generate)


def run_serve(args: argparse.Namespace) -> None:
    try:
        from .serve.command import ServeOptions, serve
    except ImportError as error:
        raise ValueError(f"hf-blockdiff serve needs the serve extra ({error}): pip install 'hf-blockdiff[serve]'") \
            from None
    options = ServeOptions(args.model, model_path(args.model), args.host, args.port, args.max_batch_size,
                           args.max_queue, args.api_key, args.request_timeout, args.tensor_parallel_size,
                           args.device, args.dtype, args.max_new_tokens is not None)
    serve(options, config_from_args(args))


def add_serve_parser(commands) -> None:
    parser = commands.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, "
                                 "/v1/chat/completions) batching requests live (needs `pip install "
                                 "'hf-blockdiff[serve]'`)")
    parser.add_argument("--model", required=True, help=f"checkpoint directory, or a bundled model "
                        f"({', '.join(BUNDLED_MODELS)}); clients send this name as `model` (required)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--max-batch-size", type=int, default=16, metavar="N",
                        help="slots: rows decoded together (default: %(default)s)")
    parser.add_argument("--max-queue", type=int, default=256, metavar="N",
                        help="rows that may wait for a slot; beyond, requests get 429 (default: %(default)s)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="clients must send `Authorization: Bearer KEY` to /v1 (default: none needed)")
    parser.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                        help="seconds a request may take before its rows are cancelled; also how long SIGTERM lets "
                        "requests in flight finish (default: %(default)s)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="only 1 for now: the live engine decodes in one process (default: %(default)s)")
    parser.add_argument("--device", help="default: the GPU if there is one, else cpu")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help=f"dtype of the weights: {', '.join(DTYPES)} (default: %(default)s)")
    parser.add_argument("--batch-invariant", dest="batch_invariant", action="store_true", default=None,
                        help="a response's bits independent of the requests decoded beside it, on GPUs too "
                        "(RuntimeOptions.batch_invariant; dense Qwen-style models; default: off)")
    add_config_flags(parser)
    parser.set_defaults(run=run_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-blockdiff", description="Block-diffusion decoding inside transformers.")
    commands = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(commands)
    bench.add_parser(commands)
    warmup.add_parser(commands)
    demo.add_parsers(commands)
    add_serve_parser(commands)
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
    except (ValueError, TypeError, OSError, FloatingPointError) as error:
        print("hf-blockdiff: error:", " ".join(str(error).split()), file=sys.stderr)  # one line, however long
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
