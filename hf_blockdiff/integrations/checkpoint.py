"""Loading a checkpoint directory (weights + tokenizer) for decoding: the CLI's and lm-eval's loader."""

from __future__ import annotations

from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")


def load_pretrained(path: str, device: str | None = None, dtype: str = "float32", tensor_parallel_size: int = 1):
    """(model, tokenizer) of the checkpoint at `path`, in eval mode, the tokenizer padding on the left.

    device None: this process's device as accelerate sees it (`cuda:LOCAL_RANK` under a launcher, else cpu).
    tensor_parallel_size N > 1: shard the weights over groups of N processes of a `torchrun` launch of N·M processes
    (transformers' tp_plan="auto"; see `distributed.init_tensor_parallel`); the device is then the launcher's."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DistributedConfig

    from .distributed import init_tensor_parallel, process_state

    if not Path(path).is_dir():
        raise ValueError(f"model path {path!r} is not a directory holding a checkpoint (config, weights, tokenizer)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tensor_parallel_size != 1:
        init_tensor_parallel(tensor_parallel_size)
        distributed = DistributedConfig(tp_plan="auto", tp_size=tensor_parallel_size)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, distributed_config=distributed)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device or process_state().device)
    return model.eval(), tokenizer
