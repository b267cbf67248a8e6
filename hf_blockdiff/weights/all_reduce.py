"""A row-parallel layer's output while decoding (`tensor_parallel.sharded_decoding`): this rank's partial product,
summed over the group's ranks. On CUDA, where torch has symmetric memory (NVLink loads and stores, no multicast), a
decode step's small messages go to our one-shot kernel (`kernels/one_shot_sum.py`: one launch that pushes the product
into every rank's slots of a symmetric buffer of its own, waits for every peer once, sums, and adds the residual stream
and the post-attention RMSNorm in its epilogue), the mid-size messages of larger batches to torch's two-shot all-reduce,
the product written into the symmetric buffer it sums; the group's backend (NCCL, gloo) sums the rest (messages beyond
the buffer, fp16 and other dtypes torch's two-shot kernel does not take, CPU) in place, the first rank's product
carrying the residual stream. One op, the product and its sum, with no copy in between (72 copies a forward of SDAR-8B);
given the decoder layer's residual stream the op adds it where the sum leaves, with the post-attention RMSNorm where
asked (`row_parallel_linear_norm`); torch.compile and CUDA graphs take it as one call (docs/benchmarks.md, "Tensor
parallel").

**Not torch's one-shot kernel.** torch's one-shot all-reduce that copies its input into the symmetric buffer
(`one_shot_all_reduce_copy_out`) summed wrong from replayed graphs on two H200s (torch 2.11): its source, as read,
signals the peers from the block's first threads right after their own copies, with no barrier of the block between,
so a peer may read before the rest of the block has written. Ours synchronizes a program's threads before it signals,
and its slots alternate by epoch, so no rank writes a slot a peer still reads (docs/benchmarks.md, "Tensor
parallel")."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..kernels import TRITON_AVAILABLE, runs_triton
from ..kernels.one_shot_sum import PROGRAMS, buffer_bytes, one_shot_sum, pad_bytes
from ..kernels.rmsnorm import add_rms_norm, add_rms_norm_reference, rms_norm, rms_norm_reference
from ..kernels.skinny_gemm import (ONE_WEIGHT_MAX_ROWS, grouped_linear, kernel_takes, linear_into,
                                   linear_residual)

# the op's kernels on two H200s (docs/benchmarks.md, "Tensor parallel"): the one-shot kernel up to 256 KB (a decode
# step's reductions at batch 1 are 32 KB), two-shot above (twice NCCL's speed at 2 MB, about a step's at batch 32),
# the backend (NCCL) beyond the buffer
ONE_SHOT_BYTES = 256 * 1024
TWO_SHOT_BYTES = 8 * 1024 * 1024
SYMMETRIC_DTYPES = (torch.bfloat16, torch.float32)
ONE_SHOT_MAX_WIDTH = 16384  # the one-shot kernel holds a row in registers
PEER_WAIT_S = 600.0  # how long the one-shot kernel waits for a peer before it traps (NCCL's default timeout)


def kind_of(size: int, width: int, dtype: torch.dtype, symmetric: bool, one_shot: bool) -> str:
    """How a message of `size` bytes, rows of `width`, is summed: "one_shot", "two_shot" or "backend" (NCCL, gloo);
    `symmetric`: the group has a symmetric buffer; `one_shot`: and the one-shot kernel's (Triton installed, room for
    its flags)."""
    if not symmetric or dtype not in SYMMETRIC_DTYPES or size > TWO_SHOT_BYTES:
        return "backend"
    if size <= ONE_SHOT_BYTES:
        return "one_shot" if one_shot and width <= ONE_SHOT_MAX_WIDTH else "backend"
    return "two_shot"


class Sums:
    """Products summed over one process group's ranks (`kind_of`), with the residual stream added."""

    def __init__(self, group):
        self.group, self.name, self.buffer, self.one_shot = group, group.group_name, None, False
        self.rank = dist.get_rank(group)
        self.carries_residual = self.rank == 0  # the backend's sum: the first rank's product carries it
        symm_mem = _symmetric_memory() if dist.get_backend(group) == "nccl" else None
        if symm_mem is not None:
            device = torch.device("cuda", torch.cuda.current_device())
            self.buffer = symm_mem.empty(TWO_SHOT_BYTES, dtype=torch.uint8, device=device)
            symm_mem.rendezvous(self.buffer, self.name)
            if TRITON_AVAILABLE:
                self._slots(symm_mem, device)

    def _slots(self, symm_mem, device) -> None:
        """The one-shot kernel's buffer of its own (slots every rank pushes into, flags in its signal pad, each
        program's epoch), where its signal pad holds the flags."""
        world = dist.get_world_size(self.group)
        memory = symm_mem.empty(buffer_bytes(world, ONE_SHOT_BYTES), dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(memory, self.name)
        offset = memory.data_ptr() - handle.buffer_ptrs[handle.rank]
        self.slots = torch.tensor([ptr + offset for ptr in handle.buffer_ptrs], dtype=torch.int64, device=device)
        self.pads = torch.tensor(handle.signal_pad_ptrs, dtype=torch.int64, device=device)
        self.epochs = torch.zeros(PROGRAMS, dtype=torch.int64, device=device)
        self.slot_memory = memory  # held: `slots` are bare addresses into every rank's copy of it
        self.one_shot = handle.signal_pad_size >= pad_bytes(world)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, skinny: bool, invariant: bool,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """[residual +] x·weightᵀ summed over the ranks (`row_parallel_linear`)."""
        kind, shared = self._written(x, weight, skinny, invariant)
        if kind == "backend":
            return self._backend_sum(x, weight, skinny, invariant, residual)
        if kind == "one_shot":
            return self._one_shot(x, weight, skinny, invariant, residual)[0]
        torch.ops.symm_mem.two_shot_all_reduce_(shared, "sum", self.name)
        return shared.clone() if residual is None else residual + shared  # out of the buffer, the residual added

    def linear_norm(self, x: torch.Tensor, weight: torch.Tensor, skinny: bool, invariant: bool,
                    residual: torch.Tensor, norm: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x·weightᵀ summed over the ranks, its RMSNorm) (`row_parallel_linear_norm`)."""
        kind, shared = self._written(x, weight, skinny, invariant)
        if kind == "backend":
            hidden = self._backend_sum(x, weight, skinny, invariant, residual)
            return hidden, (rms_norm if runs_triton(x) else rms_norm_reference)(hidden, norm, eps)
        if kind == "one_shot":
            return self._one_shot(x, weight, skinny, invariant, residual, norm, eps)
        torch.ops.symm_mem.two_shot_all_reduce_(shared, "sum", self.name)
        return (add_rms_norm if runs_triton(x) else add_rms_norm_reference)(residual, shared, norm, eps)

    def _backend_sum(self, x: torch.Tensor, weight: torch.Tensor, skinny: bool, invariant: bool,
                     residual: torch.Tensor | None) -> torch.Tensor:
        """[residual +] x·weightᵀ summed in place by the group's backend, the first rank's product carrying the
        residual."""
        out = _product(x, weight, skinny, invariant, residual if self.carries_residual else None)
        dist.all_reduce(out, group=self.group)
        return out

    def kind(self, rows: int, width: int, dtype: torch.dtype) -> str:
        """`kind_of` a [rows, width] product in this group."""
        return kind_of(rows * width * dtype.itemsize, width, dtype, self.buffer is not None, self.one_shot)

    def _written(self, x: torch.Tensor, weight: torch.Tensor, skinny: bool,
                 invariant: bool) -> tuple[str, torch.Tensor | None]:
        """(`kind_of` the product x·weightᵀ, the product written into the symmetric buffer (a view of it) where the
        two-shot kernel sums it, else None: nothing run)."""
        rows, width = x.shape[0], weight.shape[0]
        kind = self.kind(rows, width, x.dtype)
        if kind != "two_shot":
            return kind, None
        shared = self.buffer[: rows * width * x.element_size()].view(x.dtype).view(rows, width)
        if skinny and kernel_takes(rows, invariant, ONE_WEIGHT_MAX_ROWS):
            linear_into(x, weight, shared, invariant)
        else:
            torch.mm(x, weight.t(), out=shared)  # cuBLAS, as F.linear runs it, writing into the buffer
        return kind, shared

    def _one_shot(self, x: torch.Tensor, weight: torch.Tensor, skinny: bool, invariant: bool,
                  residual: torch.Tensor | None, norm: torch.Tensor | None = None,
                  eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(residual + x·weightᵀ summed over the ranks, its RMSNorm where `norm`): the product pushed into every
        rank's slots and summed by the one-shot kernel."""
        return one_shot_sum(_product(x, weight, skinny, invariant), self.slots, self.pads, self.epochs, self.rank,
                            ONE_SHOT_BYTES, residual, norm, eps, PEER_WAIT_S)


def _product(x: torch.Tensor, weight: torch.Tensor, skinny: bool, invariant: bool,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """[residual +] x·weightᵀ, a new tensor, in one launch: the skinny GEMM's op where `skinny` (which takes the rows
    it runs), else cuBLAS."""
    if skinny:
        return (grouped_linear(x, [weight], [None], invariant)[0] if residual is None else
                linear_residual(x, weight, None, residual, invariant))
    return F.linear(x, weight) if residual is None else torch.addmm(residual, x, weight.t())


def _symmetric_memory():
    """torch's symmetric memory module where its CUDA two-shot op is built, else None."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return None
    return symm_mem if hasattr(torch.ops.symm_mem, "two_shot_all_reduce_") else None


_SUMS: dict[str, Sums] = {}  # by process group name: one symmetric buffer per group, made once, collectively


@torch.library.custom_op("hf_blockdiff::row_parallel_linear", mutates_args=())
def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, group_name: str, skinny: bool, invariant: bool,
                        residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, K]·weightᵀ, this rank's shard of a row-parallel layer (no bias), summed over the group's ranks, plus
    `residual` [rows, N] where given (in the one-shot kernel's epilogue, in the copy out of the two-shot buffer, or
    in the first rank's product that the backend sums);
    `skinny`: the product on the skinny GEMM where it takes the rows (a fused forward's, `fusion/layers.py`), else
    cuBLAS; `invariant`: the skinny GEMM's batch-invariant launch (an op: torch.compile and CUDA graphs take it as
    one call)."""
    return _SUMS[group_name].linear(x, weight, skinny, invariant, residual)


@row_parallel_linear.register_fake
def _(x, weight, group_name, skinny, invariant, residual=None):
    return x.new_empty(x.shape[0], weight.shape[0])


@torch.library.custom_op("hf_blockdiff::row_parallel_linear_norm", mutates_args=())
def row_parallel_linear_norm(x: torch.Tensor, weight: torch.Tensor, group_name: str, skinny: bool, invariant: bool,
                             residual: torch.Tensor, norm: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(`row_parallel_linear` with `residual`, its RMSNorm of weight `norm`), as a decoder layer computes its residual
    stream and post-attention norm: in the one-shot kernel's epilogue, or from the two-shot buffer in one launch
    (`add_rms_norm`), instead of a copy out and an add and norm after."""
    return _SUMS[group_name].linear_norm(x, weight, skinny, invariant, residual, norm, eps)


@row_parallel_linear_norm.register_fake
def _(x, weight, group_name, skinny, invariant, residual, norm, eps):
    hidden = x.new_empty(x.shape[0], weight.shape[0])
    return hidden, hidden.new_empty(hidden.shape, dtype=torch.promote_types(norm.dtype, x.dtype))


def sums_for(group) -> str:
    """The name `row_parallel_linear` takes for `group`, its buffer made on first use: collective (a symmetric buffer's
    rendezvous), so every rank of the group calls it at the same point."""
    if group.group_name not in _SUMS:
        _SUMS[group.group_name] = Sums(group)
    return group.group_name
