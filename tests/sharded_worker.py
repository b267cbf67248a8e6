"""Run by test_large_models under `torchrun --nproc_per_node 2` on the CPU (gloo): a sharded LLaDA2 checkpoint loaded
with tp_plan="auto", and random weights of its shape built per shard, each watched for tensors of a split weight's
whole shape (a process that built or read the whole model makes them); the plain load of the same checkpoint, watched
the same way, shows that the watch sees them; the loaded and the whole model decode a batch with LLaDA2.1's editing
preset. Every process writes what it saw as JSON (OUTPUT.RANK)."""

import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM

from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.generation.engine import kv_bytes_per_token
from hf_blockdiff.integrations.distributed import build_sharded, load_sharded
from hf_blockdiff.tools.bench_models import shape_config
from hf_blockdiff.weights.shard_layout import local_weight_bytes, shard_layout

PROMPTS = torch.arange(48).view(2, 24) * 97 % 5000  # 24 tokens: the 8 new ones end the first block of 32
MASK = torch.ones_like(PROMPTS)
MASK[1, :3] = 0  # the second prompt left-padded to the first's length
# LLaDA2.1's preset with editing (its thresholds low enough that the random weights commit and edit)
CFG = dict(max_new_tokens=8, eos_token_id=[], threshold=0.1, editing_threshold=0.5, attention_backend="sdpa")


class Shapes(TorchDispatchMode):
    """Records the shape of every real (not meta, not DTensor) tensor an operation takes or makes."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, out)):
            if isinstance(t, torch.Tensor) and not hasattr(t, "to_local") and t.device.type != "meta":
                self.seen.add((func.__name__, tuple(t.shape)))
        return out


def split_shapes(model) -> set[tuple]:
    """Whole shapes of the weights tp_plan split, less those of weights kept whole."""
    shape = {name: tuple(p.shape) for name, p in model.named_parameters()}
    split = {name for name, p in model.named_parameters() if hasattr(p, "to_local") and p.to_local().shape != p.shape}
    return {shape[name] for name in split} - {shape[name] for name in shape.keys() - split}


def watched(build):
    """The model `build` makes, and the shapes of the real tensors it went through."""
    with Shapes() as watch:
        model = build()
    return model, watch.seen


def decode(model) -> dict:
    out = model.generate_multi_block(PROMPTS, BlockDiffusionConfig.from_preset("llada2_1", **CFG),
                                     attention_mask=MASK, return_dict=True)
    return {"sequences": out.sequences.tolist(), "edits": out.edits.tolist()}


def weights(model, whole) -> dict:
    """Each weight's whole and local shape, the sums of those kept whole, and the bytes this process holds."""
    parameters = {name: (list(p.shape), list(p.to_local().shape if hasattr(p, "to_local") else p.shape))
                  for name, p in model.named_parameters()}
    kept = {name: float(p.detach().double().sum()) for name, p in model.named_parameters()
            if not hasattr(p, "to_local")}
    return {"parameters": parameters, "kept_sums": kept, "local_bytes": local_weight_bytes(model),
            "whole_bytes": local_weight_bytes(whole), "layout_bytes": shard_layout(whole, 2).per_rank}


def main(checkpoint: str, output: str) -> None:
    loaded, loaded_seen = watched(lambda: load_sharded(AutoModelForCausalLM, checkpoint, 2, "cpu",
                                                       dtype=torch.float32).eval())
    whole, whole_seen = watched(lambda: AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval())
    built, built_seen = watched(lambda: build_sharded(shape_config("llada2-tiny"), 2, "cpu", torch.float32).eval())
    shapes = split_shapes(loaded)
    report = {
        "split_shapes": sorted(shapes),
        **{f"{name}_seen": sorted(f"{op} {shape}" for op, shape in seen if shape in shapes)
           for name, seen in (("loaded", loaded_seen), ("whole", whole_seen), ("built", built_seen))},
        "loaded": weights(loaded, whole), "built": weights(built, whole),
        "tokens": decode(loaded), "whole_tokens": decode(whole),
        "cache_kv_heads": loaded._blockdiff_engine.cache.keys[0].shape[2],
        "kv_bytes_per_token": [kv_bytes_per_token(loaded), kv_bytes_per_token(whole)],
    }
    with open(f"{output}.{os.environ['RANK']}", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
