"""Run by test_distributed under `torchrun --nproc_per_node W`: generation of a tiny checkpoint sharded on DEVICE (cpu:
gloo, cuda: NCCL) over groups of TP_SIZE processes (one group: plain tensor parallel; several: hybrid data × tensor
parallel), and of one whose KV heads cannot be split; with LAYERS "compiled", also with compiled decoder layers (the
collectives traced into them), a batch through the fused projections (`stacked_decode`) and PROMPTS sampled with top-k
from one seed, each process's random state moved on by its own draws (`sampled`); with SOURCE (a JSONL of
prompts), also the CLI's `generate` of it and its `bench` in the same launch (a launch of their own costs about 25 s
on the CPU); every process writes what it saw as JSON (OUTPUT.RANK)."""

import contextlib
import io
import json
import os
import sys

import torch

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.fusion import layers as fused_layers
from hf_blockdiff.generation import executor
from hf_blockdiff.kernels.skinny_gemm import stacked
from hf_blockdiff.weights.all_reduce import Sums
from hf_blockdiff.weights.tensor_parallel import layer_stacks
from hf_blockdiff.generation.engine import kv_bytes_per_token
from hf_blockdiff.integrations.checkpoint import load_pretrained
from hf_blockdiff.integrations.distributed import generate_distributed

CFG = BlockDiffusionConfig(max_new_tokens=8, threshold=0.6, eos_token_id=[])
SAMPLED = CFG.replace(temperature=0.8, top_k=5)  # top-k sampling, scored on the vocabulary shards too
SAMPLING_SEED = 5
PROMPTS = ["hello", "x = 1", "abc def", "Once upon a time", "0123456789"]
GENERATE_FLAGS = ["--batch-size", "2", "--max-new-tokens", "8", "--threshold", "0.6", "--eos-token-id"]  # CFG's
# the CLI's bench as the tests launch it, but for --device
BENCH = ["bench", "--shape", "tiny", "--batch-size", "2", "--prompt-len", "9", "--new-tokens", "8",
         "--dtype", "float32", "--skip-reference", "--json", "--tensor-parallel"]


def sharding(model) -> tuple:
    """The model's parameters (objects and types: DTensors while sharded), the modules with a forward of their own
    (transformers' tensor-parallel forwards) and the hooks before each stack of layers."""
    return ([(name, id(p), type(p).__name__) for name, p in model.named_parameters()],
            [(name, id(vars(m)["forward"])) for name, m in model.named_modules() if "forward" in vars(m)],
            [list(stack._forward_pre_hooks) for stack, _ in layer_stacks(model)])


def packed(model) -> list[bool]:
    """Per decoder layer, whether its local q/k/v shards and its gate/up shards lie back to back (load_sharded)."""
    groups = [[m.self_attn.q_proj, m.self_attn.k_proj, m.self_attn.v_proj] for _, stack in layer_stacks(model)
              for m in stack] + [[m.mlp.gate_proj, m.mlp.up_proj] for _, stack in layer_stacks(model) for m in stack]
    return [stacked([linear.weight.to_local() for linear in group]) is not None for group in groups]


def stacked_decode(model, tokenizer) -> tuple[list[str], int, int]:
    """PROMPTS four times over in one batch through the fused projections (the CPU's default backend, sdpa, has none),
    its prefill and steps past the kernel's 64 rows; how many q/k/v projections went through the stacked weight
    (max_rows: one weight of three), how many MLP forwards through stacked gate and up."""
    calls, project, mlp = [], fused_layers.grouped_linear, fused_layers.stacked_mlp_forward
    fused_layers.grouped_linear = lambda *args, **kwargs: calls.append("max_rows" in kwargs) or project(*args, **kwargs)
    fused_layers.stacked_mlp_forward = lambda self, x: calls.append("mlp") or mlp(self, x)
    try:
        wide = generate_distributed(model, PROMPTS * 4, CFG.replace(attention_backend="triton"), tokenizer,
                                    batch_size=20)
    finally:
        fused_layers.grouped_linear, fused_layers.stacked_mlp_forward = project, mlp
    return [c.text for c in wide], calls.count(True), calls.count("mlp")


def vocab_shard_starts(run) -> tuple[object, list[int]]:
    """run(), and the first token ids of the vocabulary shards its steps scored on (executor.score_vocab_shards)."""
    starts, score = [], executor.score_vocab_shards
    executor.score_vocab_shards = lambda *args: starts.append(args[1]) or score(*args)
    try:
        return run(), sorted(set(starts))
    finally:
        executor.score_vocab_shards = score


def sampled(model, tokenizer) -> tuple[list[str], list[int]]:
    """PROMPTS sampled with top-k (SAMPLED) in batches of 2 after torch.manual_seed(SAMPLING_SEED), each process's
    random state then moved on by draws of its own (none on the first), so only seeds the group agrees on give the
    tokens of one process seeded alike; and the vocabulary shards its steps scored on."""
    torch.manual_seed(SAMPLING_SEED)
    torch.rand(int(os.environ["RANK"]))
    return vocab_shard_starts(lambda: [c.text for c in generate_distributed(model, PROMPTS, SAMPLED, tokenizer,
                                                                             batch_size=2)])


def counting_sums(run) -> tuple[object, list[int]]:
    """run(), and how many row-parallel sums it ran with the post-attention norm (after the attention:
    fusion/layers.py, `attention_residual_norm`) and how many with a residual added alone (after the MLP:
    `mlp_residual`), as the compiled layers' regions hand them to the op."""
    calls, with_norm, linear = [], Sums.linear_norm, Sums.linear
    Sums.linear_norm = lambda self, *args: calls.append("norm") or with_norm(self, *args)
    Sums.linear = lambda self, *args: calls.append(len(args) > 4 and args[4] is not None) or linear(self, *args)
    try:
        return run(), [calls.count("norm"), calls.count(True)]
    finally:
        Sums.linear_norm, Sums.linear = with_norm, linear


def command_line(checkpoint: str, tp_size: str, device: str, source: str) -> dict:
    """The CLI's `generate` of `source` (CFG's settings) and its `bench` of the tiny shape, both with this launch's
    groups: their exit codes, what they printed and what `generate` wrote (SOURCE.out.jsonl, by the first process)."""
    from hf_blockdiff.cli import main as cli

    launch = ["--device", device, "--tensor-parallel-size", tp_size]
    commands = {
        "generate": ["generate", "--model", checkpoint, "--input", source, "--output", f"{source}.out.jsonl",
                     *GENERATE_FLAGS, *launch],
        "bench": [*BENCH, *launch],
    }
    runs = {}
    for name, args in commands.items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli(args)
        runs[name] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
    return runs


def main(checkpoint: str, uneven_checkpoint: str, tp_size: str, output: str, device: str, layers: str,
         source: str = "") -> None:
    """`layers`: "compiled" (also decode with compiled layers and CUDA graphs, after the eager layers) or "eager"."""
    model, tokenizer = load_pretrained(checkpoint, device, tensor_parallel_size=int(tp_size))
    before = sharding(model)
    compiled = CFG.replace(compile=True, cuda_graphs=True)  # the graphs' fixed shapes with the collectives inside
    compiled_texts, residual_sums = (counting_sums(lambda: [
        c.text for c in generate_distributed(model, PROMPTS, compiled, tokenizer, batch_size=2)])
        if layers == "compiled" else (None, [0, 0]))
    wide, stacked_qkv, stacked_mlps = stacked_decode(model, tokenizer) if layers == "compiled" else (None, 0, 0)
    top_k_texts, top_k_starts = sampled(model, tokenizer) if layers == "compiled" else (None, [])
    rows, decode = [], model.generate_multi_block
    model.generate_multi_block = lambda ids, *args, **kwargs: rows.append(len(ids)) or decode(ids, *args, **kwargs)
    # steps scored from the LM head's vocabulary shards
    completions, shard_starts = vocab_shard_starts(lambda: generate_distributed(model, PROMPTS, CFG, tokenizer,
                                                                                batch_size=2))
    again = generate_distributed(model, PROMPTS[:1], CFG, tokenizer)  # fewer prompts than groups
    try:  # refused before it loads (the head counts are checked against its config), on every process
        load_pretrained(uneven_checkpoint, device, tensor_parallel_size=int(tp_size))
        error = None
    except ValueError as failure:
        error = str(failure)
    report = {
        "completions": [c.text for c in completions],
        "again": [c.text for c in again],
        "wide": wide,
        "stacked": [stacked_qkv, stacked_mlps],
        "packed": packed(model),
        "compiled": compiled_texts,
        "residual_sums": residual_sums,
        "rows": rows,
        "vocab_shard_starts": shard_starts,
        "sampled": top_k_texts,
        "sampled_shard_starts": top_k_starts,
        "tp_size": model.tp_size,
        "device": model.device.type,
        "cache_kv_heads": model._blockdiff_engine.cache.keys[0].shape[2],
        "kv_bytes_per_token": kv_bytes_per_token(model),  # what the KV budget reckons a token takes here
        "uneven_error": error,
        "unchanged": sharding(model) == before,  # decoding on local shards put transformers' sharding back
        "command_line": command_line(checkpoint, tp_size, device, source) if source else None,
    }
    with open(f"{output}.{os.environ['RANK']}", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
