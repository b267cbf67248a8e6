"""An eval loop's calls, timed one by one: `python benchmarks/eval_loop.py [--shape sdar-4b] [--calls 8]
[--batch-size 32] [--min-prompt 16] [--max-prompt 512] [--new-tokens 128]` decodes `calls` batches of random prompts
of min–max tokens (a new draw each call, as an eval set's batches come) greedily in one process and prints, per call,
its seconds and the frames torch.compile compiled during it (docs/benchmarks.md, "Eval loops"). It uses the public API
only, so with PYTHONPATH naming another checkout it times that revision too."""

import argparse
import json
import time

import torch
from torch._dynamo.utils import counters

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.generation.hf_conventions import as_given
from hf_blockdiff.tools.bench_models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("calls", 8), ("batch-size", 32), ("min-prompt", 16), ("max-prompt", 512),
                          ("new-tokens", 128)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--shape", default="sdar-4b")
    args = parser.parse_args()
    model = build_model(args.shape, None, "cuda", torch.bfloat16)
    text = model.config.get_text_config()
    top = min(text.vocab_size, getattr(text, "mask_token_id", None) or text.vocab_size) - 1
    cfg = as_given(BlockDiffusionConfig(block_size=4, max_new_tokens=args.new_tokens, eos_token_id=[]))
    generator = torch.Generator().manual_seed(0)
    for call in range(args.calls):
        lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.batch_size,), generator=generator)
        ids = torch.randint(0, top, (args.batch_size, int(lengths.max())), generator=generator)
        mask = (torch.arange(ids.shape[1]) >= ids.shape[1] - lengths[:, None]).long()  # left padding
        frames = counters["frames"]["ok"]
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate_multi_block(ids.cuda(), cfg, attention_mask=mask.cuda())
        torch.cuda.synchronize()
        compiled = counters["frames"]["ok"] - frames
        print(json.dumps({"call": call, "longest_prompt": int(lengths.max()), "compiled_frames": compiled,
                          "seconds": round(time.perf_counter() - start, 3)}), flush=True)


if __name__ == "__main__":
    main()
