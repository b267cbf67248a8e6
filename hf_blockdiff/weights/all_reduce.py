"""The all-reduce of a row-parallel layer's partial outputs while decoding (`tensor_parallel.sharded_decoding`): a
one-shot all-reduce over symmetric memory (NVLink loads, no multicast) on CUDA for the small messages of a decode step,
the group's backend (NCCL, gloo) otherwise; an op, so torch.compile and CUDA graphs take it as one call
(docs/benchmarks.md, "Tensor parallel")."""

from __future__ import annotations

import torch
import torch.distributed as dist

# largest all-reduce taken by the symmetric-memory one-shot kernel: it beats NCCL up to about here on two H200s
# (docs/benchmarks.md, "Tensor parallel"); a decode step's reductions at batch 1 are 32 KB
ONE_SHOT_BYTES = 512 * 1024
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)


class Sums:
    """Sum over one process group's ranks: one-shot over a symmetric-memory buffer (NVLink loads, no multicast) for
    messages up to ONE_SHOT_BYTES on CUDA where torch has it, else the group's backend (NCCL, gloo)."""

    def __init__(self, group):
        self.group, self.name, self.buffer = group, group.group_name, None
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
        if device is not None and _symmetric_memory() is not None:
            symm_mem = _symmetric_memory()
            self.buffer = symm_mem.empty(ONE_SHOT_BYTES, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(self.buffer, self.name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        if self.buffer is not None and x.dtype in ONE_SHOT_DTYPES and x.numel() * x.element_size() <= ONE_SHOT_BYTES:
            flat = out.view(-1)
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(self.buffer.view(x.dtype)[: flat.numel()], x.view(-1),
                                                            "sum", self.name, flat)
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
