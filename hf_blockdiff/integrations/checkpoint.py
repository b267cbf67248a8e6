"""Loading a checkpoint directory (weights + tokenizer) for decoding: the CLI's and lm-eval's loader."""

from __future__ import annotations

from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")


def load_pretrained(path: str, device: str | None = None, dtype: str = "float32", tensor_parallel_size: int = 1,
                    expert_parallel: bool = False):
    """(model, tokenizer) of the checkpoint at `path`, in eval mode, the tokenizer padding on the left.

    device None: this process's device as accelerate sees it (`cuda:LOCAL_RANK` under a launcher, else cpu); one this
    process cannot use is a ValueError before anything loads (`check_device`).
    tensor_parallel_size N > 1: shard the weights over groups of N processes of a `torchrun` launch of N·M processes
    (transformers' tp_plan="auto"; see `distributed.load_sharded`), on `device`'s type: each process on its own GPU
    `LOCAL_RANK` (NCCL) or on the CPU (gloo); None: the GPU when the process sees one.
    expert_parallel: with tensor_parallel_size N, a MoE model's experts split whole over the N processes (num_experts
    / N each; attention stays tensor parallel); a dense model or N not dividing num_experts is a ValueError."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .distributed import load_sharded, process_state

    if not Path(path).is_dir():
        raise ValueError(f"model path {path!r} is not a directory holding a checkpoint (config, weights, tokenizer)")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {', '.join(DTYPES)}")
    if device is not None:
        check_device(device)
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tensor_parallel_size != 1 or expert_parallel:
        model = load_sharded(AutoModelForCausalLM, path, tensor_parallel_size, device, expert_parallel,
                             dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device or process_state().device)
    return model.eval(), tokenizer


def available_devices() -> list[str]:
    """The devices this process can decode on: the CPU, and each device of the accelerator torch sees."""
    import torch

    accelerator = torch.accelerator.current_accelerator()
    count = torch.accelerator.device_count() if accelerator is not None else 0
    return ["cpu"] + [f"{accelerator.type}:{index}" for index in range(count)]


def check_device(device, name: str = "device") -> None:
    """A ValueError naming `name` (the argument or flag) unless `device` (a string or torch.device) is one this
    process can use: the CPU, or the accelerator torch sees (by type, or type and an index below its count)."""
    import torch

    available = available_devices()
    try:
        wanted = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} {device!r} is no device name: pass one of {', '.join(available)}") from None
    if wanted.type == "cpu" or str(wanted) in available:
        return
    if wanted.index is None and any(entry.startswith(f"{wanted.type}:") for entry in available):
        return
    raise ValueError(f"{name} {device!r} is not available in this process (available: {', '.join(available)}): pass "
                     "one of those")
