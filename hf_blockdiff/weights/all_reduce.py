"""The all-reduce of a row-parallel layer's partial outputs while decoding (`tensor_parallel.sharded_decoding`): on
CUDA, where torch has symmetric memory (NVLink loads and stores, no multicast), torch's one-shot all-reduce for the
small messages of a decode step at small batches and its two-shot all-reduce for the mid-size ones at larger batches;
the group's backend (NCCL, gloo) otherwise. An op, so torch.compile and CUDA graphs take it as one call
(docs/benchmarks.md, "Tensor parallel").

**The one-shot kernel's two slots.** The one-shot kernel copies this rank's partial into its slot of the symmetric
buffer, waits for every rank to have done so, then reads the peers' slots; nothing says it waits for the peers to
finish reading before it returns. So a rank running ahead could copy its next message over a slot a peer is still
reading. Consecutive one-shot calls take alternate slots: a rank reaches the call after next, which takes the same slot
again, only past the next call's wait, which every peer joins only once it has read the slot. That holds in the
stream's order, and a CUDA graph replays its calls in the order they were captured, not after the calls the capture
followed; so every forward of a stack of decoder layers begins unfenced (`fence`, called by `sharded_decoding` before
each stack's forward), and its first small message goes through NCCL, which no rank leaves before every peer has
entered it: after it (or after a two-shot call, which waits for every peer on entry too) both slots are free."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

# the op's one-shot, two-shot and NCCL sums on two H200s (docs/benchmarks.md, "Tensor parallel"): one-shot the fastest
# up to 256 KB (9.4 us there against the two-shot's 10.1; a decode step's reductions at batch 1 are 32 KB), two-shot
# above (twice NCCL's speed at 2 MB, about a step's at batch 32), NCCL beyond the buffer
ONE_SHOT_BYTES = 256 * 1024
TWO_SHOT_BYTES = 8 * 1024 * 1024
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)


def kind_of(size: int, dtype: torch.dtype, symmetric: bool, fenced: bool) -> str:
    """How a message of `size` bytes is summed: "one_shot", "two_shot" or "backend" (NCCL, gloo). `symmetric`: the
    group has a symmetric buffer; `fenced`: no peer can still be reading the slot the next one-shot call takes
    (module docstring)."""
    if not symmetric or dtype not in SYMMETRIC_DTYPES or size > TWO_SHOT_BYTES:
        return "backend"
    if size > ONE_SHOT_BYTES:
        return "two_shot"
    return "one_shot" if fenced else "backend"


@dataclass
class Route:
    """Which kernel sums each message of one group and where in the symmetric buffer (`symmetric`: the group has
    one): the two-shot kernel's region, then the one-shot kernel's two slots (module docstring)."""

    symmetric: bool
    slot: int | None = None  # the slot the next one-shot call takes; None until a fencing call of the forward

    def next(self, size: int, dtype: torch.dtype) -> tuple[str, int]:
        """(kind, byte offset) of the next message of `size` bytes (`kind_of`)."""
        kind = kind_of(size, dtype, self.symmetric, self.slot is not None)
        if kind == "one_shot":
            start, self.slot = TWO_SHOT_BYTES + self.slot * ONE_SHOT_BYTES, 1 - self.slot
            return kind, start
        self.slot = 0 if self.symmetric else None  # every peer has entered this call: both slots are free
        return kind, 0


class Sums:
    """Sum over one process group's ranks (`Route`)."""

    def __init__(self, group):
        self.group, self.name, self.buffer = group, group.group_name, None
        symm_mem = _symmetric_memory() if dist.get_backend(group) == "nccl" else None
        if symm_mem is not None:
            device = torch.device("cuda", torch.cuda.current_device())
            self.buffer = symm_mem.empty(TWO_SHOT_BYTES + 2 * ONE_SHOT_BYTES, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(self.buffer, self.name)
        self.route = Route(self.buffer is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        size = x.numel() * x.element_size()
        kind, start = self.route.next(size, x.dtype)
        shared = self.buffer[start: start + size].view(x.dtype) if kind != "backend" else None
        if kind == "one_shot":
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(shared, x.view(-1), "sum", self.name, out.view(-1))
        elif kind == "two_shot":  # in place, then copied out: its `_out` form waits for the peers once more
            shared.copy_(x.view(-1))
            torch.ops.symm_mem.two_shot_all_reduce_(shared, "sum", self.name)
            out.view(-1).copy_(shared)
        else:
            out.copy_(x)
            dist.all_reduce(out, group=self.group)
        return out


def _symmetric_memory():
    """torch's symmetric memory module where its CUDA ops are built, else None."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    ops = ("one_shot_all_reduce_copy_out", "two_shot_all_reduce_")
    return symm_mem if all(hasattr(torch.ops.symm_mem, op) for op in ops) else None


_SUMS: dict[str, Sums] = {}  # by process group name: one symmetric buffer per group, made once, collectively


def fence() -> None:
    """A stack of decoder layers begins its forward: the first small message of every group goes through the backend
    (module docstring)."""
    for sums in _SUMS.values():
        sums.route.slot = None


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
