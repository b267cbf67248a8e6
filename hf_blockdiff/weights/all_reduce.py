"""The all-reduce of a row-parallel layer's partial outputs while decoding (`tensor_parallel.sharded_decoding`): torch's
two-shot all-reduce over symmetric memory (NVLink loads and stores, no multicast) on CUDA for the mid-size messages of
a decode step at larger batches, the group's backend (NCCL, gloo) otherwise; an op, so torch.compile and CUDA graphs
take it as one call (docs/benchmarks.md, "Tensor parallel").

Not torch's one-shot kernel, though it is the fastest below 512 KB: it synchronizes the ranks before reading its peers'
buffers but not after, so a rank running ahead copies its next message over the buffer a peer is still reading.
Compiled tensor-parallel layers on two GPUs decoded other tokens than one GPU with it."""

from __future__ import annotations

import torch
import torch.distributed as dist

# two-shot (each rank reduces a slice, then gathers it) against NCCL on two H200s (docs/benchmarks.md, "Tensor
# parallel"): about even below 512 KB (a decode step's reductions at batch 1 are 32 KB), twice as fast at 2 MB (about
# a step's at batch 32)
TWO_SHOT_MIN_BYTES = 512 * 1024
TWO_SHOT_BYTES = 8 * 1024 * 1024
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)


class Sums:
    """Sum over one process group's ranks: two-shot over a symmetric-memory buffer for messages from
    TWO_SHOT_MIN_BYTES to TWO_SHOT_BYTES on CUDA where torch has it, else the group's backend (NCCL, gloo)."""

    def __init__(self, group):
        self.group, self.name, self.buffer = group, group.group_name, None
        symm_mem = _symmetric_memory() if dist.get_backend(group) == "nccl" else None
        if symm_mem is not None:
            device = torch.device("cuda", torch.cuda.current_device())
            self.buffer = symm_mem.empty(TWO_SHOT_BYTES, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(self.buffer, self.name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        size = x.numel() * x.element_size()
        if self.buffer is not None and x.dtype in SYMMETRIC_DTYPES and TWO_SHOT_MIN_BYTES < size <= TWO_SHOT_BYTES:
            shared = self.buffer.view(x.dtype)[: x.numel()]
            shared.copy_(x.view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_out(shared, "sum", self.name, out.view(-1))
            return out
        out.copy_(x)
        dist.all_reduce(out, group=self.group)
        return out


def _symmetric_memory():
    """torch's symmetric memory module where its CUDA ops are built, else None."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    return symm_mem if hasattr(torch.ops.symm_mem, "two_shot_all_reduce_out") else None


_SUMS: dict[str, Sums] = {}  # by process group name: one symmetric buffer per group, made once, collectively


@torch.library.custom_op("hf_blockdiff::partial_sums", mutates_args=())
def partial_sums(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum over the group's ranks of `x`, a row-parallel layer's partial output (an op: torch.compile and CUDA
    graphs take it as one call)."""
    return _SUMS[group_name](x)


@partial_sums.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return x.new_empty(x.shape)  # contiguous, as the op returns it


def sums_for(group) -> str:
    """The name `partial_sums` takes for `group`, its buffer made on first use: collective (a symmetric buffer's
    rendezvous), so every rank of the group calls it at the same point."""
    if group.group_name not in _SUMS:
        _SUMS[group.group_name] = Sums(group)
    return group.group_name
