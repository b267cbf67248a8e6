"""A one-shot all-reduce over symmetric memory that pushes, with a decoder layer's residual add and RMSNorm after it,
in one launch: the sum of a tensor-parallel decode step's small messages (docs/benchmarks.md, "Tensor parallel").

Every rank holds a symmetric buffer of slots, [2 parities][world][slot] (`slot_bytes` each), and a signal pad of int64
flags, [PROGRAMS][world]. A launch always runs PROGRAMS programs; program p owns rows p, p + PROGRAMS, ... and counts
its launches in `epochs[p]` (this rank's own memory), so every program of a launch, on every rank, is at the same epoch
e (every rank launches the same sequence of sums). Program p stores its rows of this rank's product into slot
[e % 2][rank] of every rank's buffer over NVLink (stores, not loads: nothing waits for a round trip), synchronizes its
threads, and writes e into every peer's flag [p][rank] with release semantics at system scope; it waits until its own
flag [p][peer] has reached e for every peer (acquire), then sums its rows from its own buffer's slots in rank order in
fp32 (the same order on every rank, so every rank holds the same bits), rounds the sum to the dtype, adds the residual
stream (rounded again, as torch's add rounds) and normalizes as `rms_norm` does.

Why one wait suffices: a peer writes slot parity e % 2 again at epoch e + 2, after its launch of epoch e + 1 has
returned, which waited for this rank's arrival at e + 1, which this rank made after its launch of epoch e returned:
no rank overwrites a slot another still reads. This rests on its launches of one stream not overlapping: it is
launched without programmatic dependent launch (`dependent_launch.py`), so it starts once the kernel before it has
finished, and it never lets its dependents start early, so the kernel after it starts once it has finished. A wait
that outlasts `timeout_s` (a dead peer) traps, so the process's next CUDA call raises instead of the step hanging.

`one_shot_sum_reference` is the plain torch sum of the parts, in the same order and rounding.
"""

from __future__ import annotations

import torch

from . import INTERPRETED, TRITON_AVAILABLE, require_triton
from .compile_ahead import launch
from .rmsnorm import rms_norm_reference

PROGRAMS = 16  # programs of every launch (the epochs stay in step); rows beyond them are looped


def one_shot_sum_reference(parts: list[torch.Tensor], residual: torch.Tensor | None = None,
                           norm: torch.Tensor | None = None, eps: float = 0.0):
    """(residual + Σ parts, its RMSNorm of weight `norm` or None): the parts [rows, width] summed in fp32 in their
    order and rounded to their dtype, then the residual added as torch adds."""
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    hidden = total.to(parts[0].dtype)
    if residual is not None:
        hidden = residual + hidden
    return hidden, None if norm is None else rms_norm_reference(hidden, norm, eps)


def buffer_bytes(world: int, slot_bytes: int) -> int:
    """The symmetric buffer a group of `world` ranks needs for messages of up to `slot_bytes`."""
    return 2 * world * slot_bytes


def pad_bytes(world: int) -> int:
    """The signal pad's bytes the flags take (int64, a program's for each rank)."""
    return PROGRAMS * world * 8


def one_shot_sum(part: torch.Tensor, slots: torch.Tensor, pads: torch.Tensor, epochs: torch.Tensor, rank: int,
                 slot_bytes: int, residual: torch.Tensor | None, norm: torch.Tensor | None, eps: float,
                 timeout_s: float):
    """(residual + Σ over ranks of every rank's `part` [rows, width], its RMSNorm of weight `norm` or None).
    `slots`, `pads`: int64 [world] on this device, the address of every rank's buffer and signal pad in rank order;
    `epochs`: int64 [PROGRAMS] of this rank, zeros before the group's first launch; `timeout_s`: how long to wait for
    a peer before the launch traps."""
    require_triton("one_shot_sum")
    rows, width = part.shape
    if rows * width * part.element_size() > slot_bytes:
        raise ValueError(f"one_shot_sum: a [{rows}, {width}] {part.dtype} part exceeds the {slot_bytes}-byte slot")
    if residual is not None and (residual.shape != part.shape or residual.dtype != part.dtype):
        raise ValueError(f"residual must be [{rows}, {width}] {part.dtype}, got {list(residual.shape)} "
                         f"{residual.dtype}")
    out = torch.empty_like(part)
    normed = torch.empty(rows, width, dtype=torch.promote_types(norm.dtype, part.dtype),
                         device=part.device) if norm is not None else out
    block = triton.next_power_of_2(width)
    launch(_one_shot_sum_kernel, (PROGRAMS,),
           part.contiguous(), slots, pads, epochs, residual.contiguous() if residual is not None else out,
           norm if norm is not None else out, out, normed, rows, width, slot_bytes // part.element_size(), eps, rank,
           int(timeout_s * 1e9), WORLD=slots.numel(), BLOCK=block, HAS_RESIDUAL=residual is not None,
           HAS_NORM=norm is not None, TIMED=not INTERPRETED, PROGRAMS=PROGRAMS, num_warps=4 if block <= 2048 else 8)
    return out, normed if norm is not None else None


if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    from .rounding import round_to

    @triton.jit
    def _now():
        """The GPU's global timer, in ns."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _trap():
        """End the kernel with an error: the process's next CUDA call raises."""
        tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _wait(flag, epoch, deadline, TIMED: tl.constexpr):
        """Spin until `flag` reaches `epoch` (acquire, system scope); past `deadline` (ns, TIMED) trap."""
        seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        while seen < epoch:
            if TIMED:
                if _now() > deadline:
                    _trap()
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")

    @triton.jit
    def _push(part_ptr, slots, rows, width, slot_elems, rank, parity, cols, inside, WORLD: tl.constexpr,
              PROGRAMS: tl.constexpr):
        """This program's rows of this rank's part into slot [parity][rank] of every rank's buffer."""
        dtype = part_ptr.dtype.element_ty
        for row in range(tl.program_id(0), rows, PROGRAMS):
            at = tl.cast(row, tl.int64) * width + cols
            value = tl.load(part_ptr + at, mask=inside)
            for target in tl.static_range(WORLD):
                buffer = tl.load(slots + target).to(tl.pointer_type(dtype))
                tl.store(buffer + (parity * WORLD + rank) * slot_elems + at, value, mask=inside)

    @triton.jit(do_not_specialize=["rank"])  # one compile for every rank (ranks on one device share it)
    def _one_shot_sum_kernel(part_ptr, slots, pads, epochs, res_ptr, w_ptr, out_ptr, y_ptr, rows, width, slot_elems,
                             eps, rank, timeout_ns, WORLD: tl.constexpr, BLOCK: tl.constexpr,
                             HAS_RESIDUAL: tl.constexpr, HAS_NORM: tl.constexpr, TIMED: tl.constexpr,
                             PROGRAMS: tl.constexpr):
        program = tl.program_id(0)
        epoch = tl.load(epochs + program) + 1
        parity = epoch % 2
        cols = tl.arange(0, BLOCK)
        inside = cols < width
        _push(part_ptr, slots, rows, width, slot_elems, rank, parity, cols, inside, WORLD, PROGRAMS)
        tl.debug_barrier()  # every thread's stores issued before the release below
        for peer in tl.static_range(WORLD):
            if peer != rank:
                pad = tl.load(pads + peer).to(tl.pointer_type(tl.int64))
                tl.atomic_xchg(pad + program * WORLD + rank, epoch, sem="release", scope="sys")
        deadline = 0
        if TIMED:
            deadline = _now() + timeout_ns
        own = tl.load(pads + rank).to(tl.pointer_type(tl.int64))
        for peer in tl.static_range(WORLD):
            if peer != rank:
                _wait(own + program * WORLD + peer, epoch, deadline, TIMED)
        tl.debug_barrier()
        dtype = out_ptr.dtype.element_ty
        mine = tl.load(slots + rank).to(tl.pointer_type(dtype))
        for row in range(program, rows, PROGRAMS):
            at = tl.cast(row, tl.int64) * width + cols
            total = tl.zeros([BLOCK], dtype=tl.float32)
            for source in tl.static_range(WORLD):
                slot = mine + (parity * WORLD + source) * slot_elems
                total += tl.load(slot + at, mask=inside, other=0.0, volatile=True).to(tl.float32)
            hidden = round_to(total, dtype)
            if HAS_RESIDUAL:
                hidden = round_to(hidden + tl.load(res_ptr + at, mask=inside, other=0.0).to(tl.float32), dtype)
            tl.store(out_ptr + at, hidden.to(dtype), mask=inside)
            if HAS_NORM:
                inv = 1.0 / tl.sqrt_rn(tl.sum(hidden * hidden, axis=0) / width + eps)
                weight = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
                normed = weight * round_to(hidden * inv, dtype)
                tl.store(y_ptr + at, normed.to(y_ptr.dtype.element_ty), mask=inside)
        tl.store(epochs + program, epoch)
