"""`hf-blockdiff warmup --cache-dir DIR (--model PATH | --shape NAME) --batch-sizes 1,32,128`: decode random prompts at
each batch size so that every compile those calls need happens now, and save torch.compile's artifacts to DIR
(`integrations/compile_cache.py`). A later process that loads DIR before its first call (`compile_cache.load`,
`hf-blockdiff bench --compile-cache DIR`, `BlockDiffusionEvalCallback(compile_cache=DIR)`) reads them instead of
compiling: an image build or the start of a training job pays the compiling once. It decodes with bench's decode
flags (`tools/decode_flags.py`), so a bench with the same flags and --new-tokens loads the step's bookkeeping too,
whose artifacts are kept per decode config."""

from __future__ import annotations

import argparse

import torch

from ..integrations import compile_cache
from ..integrations.checkpoint import check_device
from .bench_models import SHAPES, build_model, parse_batch_sizes
from .decode_flags import add_decode_flags, decode_config


def run_warmup(args: argparse.Namespace) -> None:
    check_device(args.device, "--device")
    if args.prompt_len < 1 or args.new_tokens < 1:
        raise ValueError("--prompt-len and --new-tokens need at least 1.")
    model = build_model(args.shape, args.model, args.device, getattr(torch, args.dtype))
    path = compile_cache.warmup(model, args.cache_dir, args.batch_sizes, args.prompt_len, decode_config(args, model))
    print(f"compile artifacts saved to {path}" if path else "nothing was compiled: nothing saved (see the warnings)")


def add_parser(commands) -> None:
    parser = commands.add_parser("warmup", help="compile a model's decoding ahead and save the artifacts to a "
                                 "directory later processes load")
    parser.add_argument("--cache-dir", required=True, help="directory of the compile artifacts (required)")
    parser.add_argument("--model", help="a checkpoint directory (default: random weights of --shape)")
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                        help="architecture sizes with random weights when there is no --model (default: %(default)s)")
    parser.add_argument("--batch-sizes", type=parse_batch_sizes, default=(1, 32, 128),
                        help="batch sizes to compile for, comma-separated (default: 1,32,128)")
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated per prompt, as bench's "
                        "(default: %(default)s)")
    add_decode_flags(parser)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: cuda if there is a GPU, else cpu (here: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="dtype of the weights (default: %(default)s)")
    parser.set_defaults(run=run_warmup)
