"""The all-reduce of a row-parallel layer's partial outputs while decoding (`tensor_parallel.sharded_decoding`): torch's
one-shot and two-shot all-reduces over symmetric memory (NVLink loads and stores, no multicast) on CUDA for the
messages of a decode step, the group's backend (NCCL, gloo) otherwise; an op, so torch.compile and CUDA graphs take it
as one call (docs/benchmarks.md, "Tensor parallel")."""

from __future__ import annotations

import torch
import torch.distributed as dist

# the symmetric-memory kernels against NCCL on two H200s (docs/benchmarks.md, "Tensor parallel"): one-shot (every
# rank loads every peer's copy) wins up to about 512 KB, a decode step's reductions at batch 1 being 32 KB; two-shot
# (each rank reduces a slice, then gathers) from there to the buffer's size, at batch 32 about 1.3 MB
ONE_SHOT_BYTES = 512 * 1024
TWO_SHOT_BYTES = 8 * 1024 * 1024
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)


class Sums:
    """Sum over one process group's ranks: over a symmetric-memory buffer (NVLink loads and stores, no multicast) on
    CUDA where torch has it, one-shot up to ONE_SHOT_BYTES and two-shot up to TWO_SHOT_BYTES, else the group's backend
    (NCCL, gloo)."""

    def __init__(self, group):
        self.group, self.name, self.buffer = group, group.group_name, None
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
        if device is not None and _symmetric_memory() is not None:
            symm_mem = _symmetric_memory()
            self.buffer = symm_mem.empty(TWO_SHOT_BYTES, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(self.buffer, self.name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        size = x.numel() * x.element_size()
        if self.buffer is not None and x.dtype in SYMMETRIC_DTYPES and size <= TWO_SHOT_BYTES:
            shared, flat = self.buffer.view(x.dtype)[: x.numel()], x.view(-1)
            if size <= ONE_SHOT_BYTES:
                torch.ops.symm_mem.one_shot_all_reduce_copy_out(shared, flat, "sum", self.name, out.view(-1))
            else:
                shared.copy_(flat)
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
    return symm_mem if hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out") else None


_SUMS: dict[str, Sums] = {}  # by process group name: one symmetric buffer per group, made once, collectively


@torch.library.custom_op("hf_blockdiff::partial_sums", mutates_args=())
def partial_sums(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum over the group's ranks of `x`, a row-parallel layer's partial output (an op: torch.compile and CUDA
    graphs take it as one call)."""
    return _SUMS[group_name](x)


@partial_sums.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


def sums_for(group) -> str:
    """The name `partial_sums` takes for `group`, its buffer made on first use: collective (a symmetric buffer's
    rendezvous), so every rank of the group calls it at the same point."""
    if group.group_name not in _SUMS:
        _SUMS[group.group_name] = Sums(group)
    return group.group_name
