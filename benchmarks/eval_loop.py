"""An eval loop's calls, timed one by one, for several model families in one process: `python benchmarks/eval_loop.py
[--shapes sdar-4b llada2-mini:4 diffusion-gemma-26b-a4b:4] [--calls 8] [--batch-sizes 32,24,32,16,28,32,20,30]
[--new-tokens 128,64] [--min-prompt 16] [--max-prompt 512] [--denoising-steps 16] [--device cuda|cpu]
[--compile-cache DIR]` decodes, per
shape (`NAME:LAYERS` keeps its first LAYERS layers), `calls` batches of random prompts of min–max tokens (a new draw
each call, as an eval set's batches come; call i takes the i-th batch size and new-token count, cycling) greedily and
prints, per call, its seconds, the frames torch.compile compiled during it, dynamo's recompile reasons and the CUDA
graphs captured; then per family the steady state (median of the last half of the calls) and the rule of issue 39:
no frame compiled after the first call, no later call over twice the steady state (docs/benchmarks.md, "Eval
loops"). DiffusionGemma runs every canvas for `--denoising-steps` steps (adaptive stopping never fires), so its calls
do comparable work. `--device cpu` runs tiny shapes (a smoke test: nothing compiles on the CPU by default). It uses
the public API only, so with PYTHONPATH naming another checkout it times that revision too."""

import argparse
import gc
import json
import logging
import statistics
import time
from contextlib import contextmanager

import torch
from torch._dynamo.utils import counters

from hf_blockdiff import BlockDiffusionConfig, free_cache
from hf_blockdiff.generation.hf_conventions import as_given
from hf_blockdiff.integrations import compile_cache
from hf_blockdiff.tools.bench_models import SHAPES, build_model, prompt_ceiling
from hf_blockdiff.tools.diffusion_gemma_bench import NEVER_CONFIDENT
from hf_blockdiff.tools.diffusion_gemma_bench import build as build_diffusion_gemma

DEFAULTS = {  # per device: shapes, batch sizes, new tokens, prompt lengths
    "cuda": (["sdar-4b", "llada2-mini:4", "diffusion-gemma-26b-a4b:4"], "32,24,32,16,28,32,20,30", "128,64", 16, 512),
    "cpu": (["tiny", "llada2-tiny", "diffusion-gemma-tiny"], "4,3,4,2", "8,16", 4, 40),
}
RECOMPILES = "torch._dynamo.guards.__recompiles"  # dynamo's `recompiles` log


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shapes", nargs="+", help="NAME or NAME:LAYERS (tools/bench_models.py SHAPES)")
    parser.add_argument("--batch-sizes", help="comma-separated, one per call, cycling")
    parser.add_argument("--new-tokens", help="comma-separated, one per call, cycling")
    parser.add_argument("--min-prompt", type=int)
    parser.add_argument("--max-prompt", type=int)
    parser.add_argument("--calls", type=int, default=8)
    parser.add_argument("--denoising-steps", type=int, default=16)
    parser.add_argument("--compile-cache", metavar="DIR", help="compile_cache.load(model, DIR) before the first call "
                        "and compile_cache.save(model, DIR) after the last (default: none)")
    args = parser.parse_args(argv)
    shapes, batches, new, low, high = DEFAULTS[args.device]
    args.shapes = args.shapes or shapes
    args.batch_sizes = [int(b) for b in (args.batch_sizes or batches).split(",")]
    args.new_tokens = [int(n) for n in (args.new_tokens or new).split(",")]
    args.min_prompt, args.max_prompt = args.min_prompt or low, args.max_prompt or high
    return args


def build(spec: str, device: str):
    """(model, config of a call with `new` tokens, largest prompt id) of `NAME[:LAYERS]`."""
    name, _, layers = spec.partition(":")
    layers = int(layers) if layers else None
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if SHAPES[name]["model_type"] == "diffusion_gemma":
        model = build_diffusion_gemma(name, layers, device, dtype)
        return model, lambda new, steps: BlockDiffusionConfig(
            max_new_tokens=new, max_denoising_steps=steps, stop_confidence=NEVER_CONFIDENT, eos_token_id=[])
    model = build_model(name, None, device, dtype, layers=layers)
    return model, lambda new, steps: as_given(BlockDiffusionConfig(block_size=4, max_new_tokens=new,
                                                                   eos_token_id=[]))


@contextmanager
def watching():
    """Yields a function that returns, since the last time it was called: (frames compiled, recompile reasons (their
    first three lines), CUDA graph captures, those thrown away after compiling ahead included)."""
    reasons, captures = [], [0]

    class Reasons(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reasons.append(" ".join(line.strip() for line in record.getMessage().splitlines()[:3]))

    log = logging.getLogger(RECOMPILES)
    handler, propagate = Reasons(), log.propagate
    torch._logging.set_logs(recompiles=True)
    log.addHandler(handler)
    log.propagate = False  # here, not on stderr
    begin = torch.cuda.CUDAGraph.capture_begin

    def counting_begin(self, *args, **kwargs):
        captures[0] += 1
        return begin(self, *args, **kwargs)

    torch.cuda.CUDAGraph.capture_begin = counting_begin
    seen = [counters["frames"]["ok"], 0, 0]

    def since() -> tuple[int, list[str], int]:
        now = [counters["frames"]["ok"], len(reasons), captures[0]]
        frames, new, graphs = now[0] - seen[0], reasons[seen[1]:], now[2] - seen[2]
        seen[:] = now
        return frames, new, graphs

    try:
        yield since
    finally:
        torch.cuda.CUDAGraph.capture_begin = begin
        log.removeHandler(handler)
        log.propagate = propagate
        torch._logging.set_logs()


def run_family(spec: str, args, since) -> list[dict]:
    """The loop's calls on one model, a row each."""
    device = args.device
    model, config = build(spec, device)
    if args.compile_cache:
        start = time.perf_counter()
        compile_cache.load(model, args.compile_cache)
        print(f"{spec}: compile_cache.load {time.perf_counter() - start:.2f} s", flush=True)
    top = prompt_ceiling(model)
    generator = torch.Generator().manual_seed(0)
    since()  # what building compiled is not the loop's
    rows = []
    for call in range(args.calls):
        batch, new = args.batch_sizes[call % len(args.batch_sizes)], args.new_tokens[call % len(args.new_tokens)]
        lengths = torch.randint(args.min_prompt, args.max_prompt + 1, (batch,), generator=generator)
        ids = torch.randint(3, top, (batch, int(lengths.max())), generator=generator)
        mask = (torch.arange(ids.shape[1]) >= ids.shape[1] - lengths[:, None]).long()  # left padding
        synchronize(device)
        start = time.perf_counter()
        model.generate_multi_block(ids.to(device), config(new, args.denoising_steps), attention_mask=mask.to(device))
        synchronize(device)
        seconds = time.perf_counter() - start
        frames, reasons, graphs = since()
        rows.append(dict(family=spec, call=call + 1, batch=batch, longest=int(lengths.max()), new_tokens=new,
                         seconds=round(seconds, 3), frames=frames, graphs=graphs, recompiles=reasons))
        print(json.dumps(rows[-1]), flush=True)
    if args.compile_cache:  # what the loop looked up, the worker's artifacts included, loads in the next process's load
        compile_cache.settle()
        compile_cache.save(model, args.compile_cache)
    free_cache(model)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def verdict(rows: list[dict]) -> dict:
    """Steady state (median of the last half of the calls) and issue 39's rule for one family's calls."""
    seconds = [row["seconds"] for row in rows]
    steady = statistics.median(seconds[len(seconds) // 2:])
    slowest = max(seconds[1:], default=0.0)
    late_frames = sum(row["frames"] for row in rows[1:])
    return dict(family=rows[0]["family"], steady_s=round(steady, 3), slowest_later_s=slowest,
                frames_after_first=late_frames, rule="ok" if slowest <= 2 * steady and late_frames == 0 else "FAIL")


def table(rows: list[dict]) -> str:
    """A markdown table of the calls and a line of the verdict, per family."""
    lines = []
    for family in dict.fromkeys(row["family"] for row in rows):
        calls = [row for row in rows if row["family"] == family]
        lines += [f"\n{family}", "| call | batch | longest | new | seconds | frames | graphs | recompile reasons |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['call']} | {r['batch']} | {r['longest']} | {r['new_tokens']} | {r['seconds']} | "
                  f"{r['frames']} | {r['graphs']} | {'; '.join(r['recompiles'])[:300]} |" for r in calls]
        v = verdict(calls)
        lines.append(f"steady state {v['steady_s']} s; slowest later call {v['slowest_later_s']} s; frames after "
                     f"call 1: {v['frames_after_first']}; rule (no later call > 2x steady, no frame after call 1): "
                     f"{v['rule']}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    start, rows = time.perf_counter(), []
    with watching() as since:
        for spec in args.shapes:
            rows += run_family(spec, args, since)
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(table(rows), f"\n{device}, torch {torch.__version__}: {time.perf_counter() - start:.0f} s in all", flush=True)
    return rows


if __name__ == "__main__":
    main()
