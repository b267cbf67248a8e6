"""The all-reduce of a row-parallel layer's partial outputs while decoding (`tensor_parallel.sharded_decoding`): on
CUDA, where torch has symmetric memory (NVLink loads and stores, no multicast), torch's two-shot all-reduce for the
mid-size messages of a decode step at larger batches; the group's backend (NCCL, gloo) for the small ones and
beyond the buffer. An op, so torch.compile and CUDA graphs take it as one call (docs/benchmarks.md, "Tensor
parallel").

**No one-shot kernel.** torch's one-shot all-reduce that copies its input into the symmetric buffer
(`one_shot_all_reduce_copy_out`) summed wrong from replayed graphs on two H200s (torch 2.11). Its source, as read,
signals the peers from the block's first threads right after their own copies, with no barrier of the block
between, so a peer may read before the rest of the block has written (docs/benchmarks.md, "Tensor parallel"). At a
decode step's small messages NCCL took 1.3 us more per call, and whole steps ran within their spread. The two-shot
kernel reads only what an earlier kernel wrote (the copy in) and waits for every peer before it returns, so one
buffer serves every call."""

from __future__ import annotations

import torch
import torch.distributed as dist

# the op's two-shot and NCCL sums on two H200s (docs/benchmarks.md, "Tensor parallel"): NCCL up to 256 KB (a decode
# step's reductions at batch 1 are 32 KB), two-shot above (twice NCCL's speed at 2 MB, about a step's at batch 32),
# NCCL again beyond the buffer
BACKEND_BYTES = 256 * 1024
TWO_SHOT_BYTES = 8 * 1024 * 1024
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)


def kind_of(size: int, dtype: torch.dtype, symmetric: bool) -> str:
    """How a message of `size` bytes is summed: "two_shot" or "backend" (NCCL, gloo); `symmetric`: the group has a
    symmetric buffer."""
    two_shot = symmetric and dtype in SYMMETRIC_DTYPES and BACKEND_BYTES < size <= TWO_SHOT_BYTES
    return "two_shot" if two_shot else "backend"


class Sums:
    """Sum over one process group's ranks (`kind_of`)."""

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
        if kind_of(size, x.dtype, self.buffer is not None) == "two_shot":
            # in place, then copied out: its `_out` form waits for the peers once more
            shared = self.buffer[:size].view(x.dtype)
            shared.copy_(x.view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_(shared, "sum", self.name)
            out.view(-1).copy_(shared)
        else:
            out.copy_(x)
            dist.all_reduce(out, group=self.group)
        return out


def _symmetric_memory():
    """torch's symmetric memory module where its CUDA two-shot op is built, else None."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    return symm_mem if hasattr(torch.ops.symm_mem, "two_shot_all_reduce_") else None


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
