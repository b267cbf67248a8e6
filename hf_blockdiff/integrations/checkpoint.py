"""Loading a checkpoint directory (weights + tokenizer) for decoding: the CLI's and lm-eval's loader."""

from __future__ import annotations

import os
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")


def load_pretrained(path: str, device: str | None = None, dtype: str = "float32", tensor_parallel: bool = False):
    """(model, tokenizer) of the checkpoint at `path`, in eval mode, the tokenizer padding on the left.

    device None: this process's device as accelerate sees it (`cuda:LOCAL_RANK` under a launcher, else cpu).
    tensor_parallel: shard the weights over the processes of a `torchrun` launch (transformers' tp_plan="auto");
    the device is then the launcher's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

    from .distributed import process_state

    if not Path(path).is_dir():
        raise ValueError(f"model path {path!r} is not a directory holding a checkpoint (config, weights, tokenizer)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tensor_parallel:
        if int(os.environ.get("WORLD_SIZE", "1")) < 2:
            raise ValueError("tensor parallelism shards over several processes: launch with "
                             "`torchrun --nproc_per_node N ...` (N dividing the model's attention head counts)")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype,
                                                     distributed_config=DistributedConfig(tp_plan="auto"))
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device or process_state().device)
    return model.eval(), tokenizer
