"""`python -m hf_blockdiff.tools.model_matrix`: every released family at its released width (random weights,
tools/bench_models.py's shapes; layers cut where the time or the memory of one 80 GB GPU needs it), decoded under the
default fast path and under eager sdpa (`attention_backend="sdpa", cuda_graphs=False, compile=False`).

Each cell (family, batch, path) decodes a left-padded batch of mixed prompt lengths twice (the first call compiles
and captures) and reports: no error (else the exception's type and message; the matrix goes on), no mask id left in
the generated tokens (DiffusionGemma's canvas has no mask token), tok/s of the second call. Each family also gets a
correctness cell: fp32, 2 layers, batch 2, 16 new tokens, the fast path's tokens equal to eager sdpa's (in bf16 they
agree only up to the first near-tie). One markdown table is printed at the end; every cell is also a JSON line of
`--output`, written as soon as it finishes (a run cut short keeps what it did).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import BlockDiffusionConfig
from ..generation.hf_conventions import as_given
from ..patching import free_cache
from ..config.profiles import model_profile
from .bench_models import SHAPES, build_model, parse_batch_sizes
from .measure import measure, recompile_limits_hit

PATHS = {"fast": {}, "eager-sdpa": dict(attention_backend="sdpa", cuda_graphs=False, compile=False)}
CANVAS = "diffusion_gemma"  # model type decoded canvas by canvas: no mask token, its own builder


@dataclass(frozen=True)
class Family:
    layers: int | None  # decoder layers kept (None: all)
    batches: tuple[int, ...] = (1, 8, 128)


FAMILIES = {  # the released families (TraDo-8B has SDAR-8B's shape: tools/bench_models.py)
    "sdar-1.7b": Family(None),
    "sdar-4b": Family(None),
    "sdar-8b": Family(None),
    "sdar-30b-a3b": Family(8, (1, 8, 16)),  # 61 GB of bf16 weights in all
    "llada-8b": Family(8),  # bidirectional: every step recomputes the whole canvas
    "llada2-mini": Family(8),
    "dream-7b": Family(8),  # bidirectional
    "fast-dllm-v2-7b": Family(None),
    "diffusion-gemma-26b-a4b": Family(6, (1, 8, 16)),  # 6: one full-attention layer after five sliding ones
}


def build(shape: str, layers: int | None, device: str, dtype: torch.dtype):
    """Random weights of `shape` built on `device` in `dtype` (never a whole model on the host)."""
    torch.manual_seed(0)
    if SHAPES[shape]["model_type"] == CANVAS:
        from .diffusion_gemma_bench import build as build_canvas_model

        return build_canvas_model(shape, layers, device, dtype)
    return build_model(shape, None, device, dtype, layers=layers)


def prompts(model, batch: int, longest: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of `batch` random prompts of mixed lengths in (longest/2, longest], left-padded;
    no prompt holds the mask id."""
    text = model.config.get_text_config()
    mask_id = mask_token(model)
    high = text.vocab_size if mask_id is None else min(text.vocab_size, mask_id)
    generator = torch.Generator().manual_seed(batch)
    ids = torch.zeros(batch, longest, dtype=torch.long)
    attention = torch.zeros(batch, longest, dtype=torch.long)
    for row in range(batch):
        length = longest - (7 * row) % max(longest // 2, 1)
        ids[row, longest - length:] = torch.randint(3, high, (length,), generator=generator)
        attention[row, longest - length:] = 1
    return ids.to(device), attention.to(device)


def mask_token(model) -> int | None:
    """The mask id decoding fills blocks with (None: a canvas model, which starts from noise)."""
    return None if model.config.model_type == CANVAS else model_profile(model).mask_token_id


def decode(model, ids: torch.Tensor, attention: torch.Tensor, new_tokens: int, path: str) -> tuple[torch.Tensor, int]:
    """(generated tokens, forwards) of one call on the fast path or eager sdpa; the family's profile sets the rest.
    The same seed every call: a canvas model's starting noise and any sampling repeat."""
    cfg = as_given(BlockDiffusionConfig(max_new_tokens=new_tokens, eos_token_id=[], **PATHS[path]))
    out = model.generate_multi_block(ids, cfg, attention_mask=attention, return_dict=True,
                                     generator=torch.Generator().manual_seed(0))
    return out.sequences[:, ids.shape[1]:], out.num_forwards


def generated_length(model, wanted: int) -> int:
    """`wanted` new tokens, rounded up to whole canvases for a canvas model (it denoises them whole)."""
    if model.config.model_type != CANVAS:
        return wanted
    return -(-wanted // model.config.canvas_length) * model.config.canvas_length


def speed_cell(model, batch: int, path: str, args) -> dict:
    """One cell: two calls, the second timed; the mask ids left in its tokens."""
    ids, attention = prompts(model, batch, args.prompt_len, args.device)
    new, tokens = generated_length(model, args.new_tokens), []

    def call():
        generated, forwards = decode(model, ids, attention, new, path)
        tokens.append(generated)
        return forwards

    first = measure("first call", call, args.device, batch * new, batch)
    timed = measure("second call", call, args.device, batch * new, batch)
    mask_id = mask_token(model)
    return {"new_tokens": new, "first_call_s": round(first.seconds, 2), **timed.row(),
            "mask_left": None if mask_id is None else int((tokens[-1] == mask_id).sum())}


def correctness_cell(shape: str, args) -> dict:
    """fp32, 2 layers, batch 2, 16 new tokens: the fast path's tokens against eager sdpa's."""
    model = build(shape, 2, args.device, torch.float32)
    try:
        ids, attention = prompts(model, 2, 32, args.device)
        fast, sdpa = (decode(model, ids, attention, 16, path)[0] for path in PATHS)
    finally:
        free_cache(model)
        del model
        forget()
    differ = (fast != sdpa).nonzero().tolist()
    return {"equal": not differ, "first_difference": differ[0] if differ else None}


def forget() -> None:
    """After the last reference to a model is dropped: give its memory back and forget the code compiled for it."""
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def cell(record: dict, work) -> dict:
    """`record` with `work()`'s fields, or the exception it raised (type and first line), and the recompile limits
    dynamo hit meanwhile (past one, that code ran eager); never raises."""
    with recompile_limits_hit() as hits:
        try:
            result = {**record, "ok": True, **work()}
        except Exception as error:  # a cell's failure is its result: the matrix goes on
            lines = str(error).strip().splitlines() or [""]
            result = {**record, "ok": False, "error": f"{type(error).__name__}: {lines[0][:300]}"}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return {**result, "recompile_limit_hits": hits}


def run_family(name: str, family: Family, args, emit) -> None:
    """The family's speed cells (batch by path), then its correctness cell, each emitted as it finishes."""
    batches, dtype = args.batches or family.batches, getattr(torch, args.dtype)
    layers = family.layers if args.layers is None else args.layers
    built = cell({"family": name, "cell": "build"}, lambda: {"model": build(name, layers, args.device, dtype)})
    model = built.pop("model", None)
    if model is not None:
        layers = model.config.get_text_config().num_hidden_layers
    for batch in batches:
        for path in PATHS:
            record = {"family": name, "layers": layers, "batch": batch, "path": path, "dtype": args.dtype}
            emit(cell(record, lambda: speed_cell(model, batch, path, args)) if model is not None
                 else {**record, **{key: built[key] for key in ("ok", "error")}})
    if model is not None:
        free_cache(model)
    del model
    forget()
    emit(cell({"family": name, "layers": 2, "batch": 2, "path": "fast = eager-sdpa", "dtype": "float32"},
              lambda: correctness_cell(name, args)))


def table(records: list[dict]) -> str:
    """The markdown table of every cell."""
    lines = ["| family | layers | batch | path | dtype | result | mask ids left | tok/s | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if not r["ok"]:
            result, notes = "error", r["error"]
        elif "equal" in r:
            result, notes = ("equal", "") if r["equal"] else ("differ", f"first difference at {r['first_difference']}")
        else:
            result, notes = ("ok" if not r["mask_left"] else "mask ids left"), f"{r['new_tokens']} new tokens"
        if r.get("recompile_limit_hits"):
            notes += f"; {len(r['recompile_limit_hits'])} recompile limit hit(s): part ran eager"
        mask_left = r.get("mask_left", "")
        cells = [r["family"], r["layers"] or "all", r["batch"], r["path"], r["dtype"], result,
                 "n/a" if mask_left is None else mask_left, r.get("tok_s", ""), notes.replace("|", "/")]
        lines.append("| " + " | ".join(str(value) for value in cells) + " |")
    return "\n".join(lines)


def _names(text: str) -> list[str]:
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in SHAPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: pass shape names from {', '.join(sorted(SHAPES))}, "
                                         "comma-separated")
    return names


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m hf_blockdiff.tools.model_matrix", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", type=_names, default=list(FAMILIES),
                        help=f"shapes to run, comma-separated (default: {','.join(FAMILIES)})")
    parser.add_argument("--batches", type=parse_batch_sizes, default=None,
                        help="batch sizes of every family, comma-separated (default: each family's: 1,8,128; the "
                        "largest MoE models 1,8,16)")
    parser.add_argument("--layers", type=int, default=None,
                        help="decoder layers of every family (default: each family's budget, in the table)")
    parser.add_argument("--prompt-len", type=int, default=256, help="longest prompt (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per prompt, whole canvases for "
                        "DiffusionGemma (default: %(default)s)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="dtype of the speed cells (default: %(default)s; correctness cells: float32)")
    parser.add_argument("--output", type=Path, default=Path(os.environ.get("OUT", "/tmp/hf_blockdiff_gpu"))
                        / "model_matrix.jsonl", help="JSON lines, one per cell, appended (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1 or args.prompt_len < 2 or args.new_tokens < 1:
        parser.error("--layers, --new-tokens need at least 1, --prompt-len at least 2")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    records = []

    def emit(record: dict) -> None:
        records.append(record)
        with args.output.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(json.dumps(record), file=sys.stderr, flush=True)

    for name in args.families:
        run_family(name, FAMILIES.get(name, Family(None)), args, emit)
    print(table(records))
    return records


if __name__ == "__main__":
    main()
