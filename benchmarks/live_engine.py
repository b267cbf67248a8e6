"""The live engine against offline decoding of the same prompts: `python benchmarks/live_engine.py [--shape sdar-4b]
[--rows 128] [--batch-size 128] [--min-prompt 16] [--max-prompt 512] [--new-tokens 128] [--temperature 0]
[--mixed] [--device cuda]` decodes `rows` random prompts once offline (`generate_multi_block` at `batch-size` rows) and once through
a `LiveEngine` of `batch-size` slots with every row submitted at once, after a warm-up of each, and prints the
tokens per second of both, their ratio and how many served rows equal their offline row token for token. `--mixed`
gives every other served row its own temperature and top-k (the per-row scoring path; offline then runs those rows
in calls of their own settings)."""

import argparse
import json
import threading
import time

import torch

from hf_blockdiff import BlockDiffusionConfig, free_cache
from hf_blockdiff.generation.hf_conventions import as_given
from hf_blockdiff.generation.live import LiveEngine, RowSettings, row_seeds
from hf_blockdiff.tools.bench_models import build_model


def offline(model, cfg, prompts, settings, batch):
    """Each row's generated tokens and noise seed, decoding the rows of equal settings together in calls of `batch`
    rows, each call with generator seed 0 (so a row's seed is `row_seeds(0, len(call))[its place in the call]`)."""
    out, seeds = [None] * len(prompts), [None] * len(prompts)
    for key in {tuple(sorted(s.items())) for s in settings}:
        rows = [i for i, s in enumerate(settings) if tuple(sorted(s.items())) == key]
        for start in range(0, len(rows), batch):
            chunk = rows[start:start + batch]
            width = max(len(prompts[i]) for i in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(chunk):
                ids[row, width - len(prompts[i]):], mask[row, width - len(prompts[i]):] = prompts[i], 1
            tokens = model.generate_multi_block(ids.to(model.device), cfg, attention_mask=mask.to(model.device), **dict(key),
                                                generator=torch.Generator().manual_seed(0))[:, width:]
            for row, (i, seed) in enumerate(zip(chunk, row_seeds(0, len(chunk)))):
                out[i], seeds[i] = tokens[row].tolist(), seed
    return out, seeds


def served(engine, prompts, settings, seeds):
    tokens, done = [[] for _ in prompts], [threading.Event() for _ in prompts]

    def collect(i):
        def on_update(update):
            tokens[i].extend(update.tokens)
            if update.finish_reason is not None:
                done[i].set()
        return on_update

    for i, prompt in enumerate(prompts):
        engine.submit(prompt.tolist(), RowSettings(seed=seeds[i], **settings[i]), collect(i))
    for event in done:
        event.wait()
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("rows", 128), ("batch-size", 128), ("min-prompt", 16), ("max-prompt", 512),
                          ("new-tokens", 128)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--shape", default="sdar-4b")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--mixed", action="store_true")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    model = build_model(args.shape, None, args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)
    sync = torch.cuda.synchronize if args.device == "cuda" else lambda: None
    text = model.config.get_text_config()
    top = min(text.vocab_size, getattr(text, "mask_token_id", None) or text.vocab_size) - 1
    cfg = as_given(BlockDiffusionConfig(block_size=4, max_new_tokens=args.new_tokens, eos_token_id=[],
                                        temperature=args.temperature))
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (args.rows,), generator=generator)
    prompts = [torch.randint(0, top, (int(n),), generator=generator) for n in lengths]
    settings = [dict(temperature=0.7, top_k=50) if args.mixed and i % 2 else {} for i in range(args.rows)]
    times = {}
    for _ in range(2):  # a warm-up (compiles, captures), then the timed run
        sync()
        start = time.perf_counter()
        expected, seeds = offline(model, cfg, prompts, settings, args.batch_size)
        sync()
        times["offline"] = time.perf_counter() - start
    free_cache(model)
    if args.device == "cuda":
        torch.cuda.empty_cache()  # the live engine sizes its KV pool to the memory free now
    engine = LiveEngine(model, cfg, max_batch_size=args.batch_size, max_prompt_tokens=args.max_prompt,
                        max_new_tokens=args.new_tokens)
    engine.start()
    for _ in range(2):
        sync()
        start = time.perf_counter()
        got = served(engine, prompts, [dict(max_new_tokens=args.new_tokens, **s) for s in settings], seeds)
        sync()
        times["served"] = time.perf_counter() - start
    engine.close()
    tokens = args.rows * args.new_tokens
    print(json.dumps({"offline_tok_s": round(tokens / times["offline"], 1),
                      "served_tok_s": round(tokens / times["served"], 1),
                      "served_over_offline": round(times["offline"] / times["served"], 3),
                      "rows_equal": sum(a == b for a, b in zip(got, expected)), "rows": args.rows}))


if __name__ == "__main__":
    main()
