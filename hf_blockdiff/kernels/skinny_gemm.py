"""Skinny GEMMs: the decoder's projections in a forward of few tokens (a decode step at small batch), where reading
the weights is all the time there is.

grouped_linear(x, weights, biases) = [x·Wᵢᵀ + bᵢ for each i] in one launch (a layer's q, k and v projections, which
cuBLAS runs as three kernels, the small k and v ones at a third of the memory bandwidth).
gated_linear(x, gate, up) = silu(x·Wgᵀ)·(x·Wuᵀ), rounded as transformers' gated MLP rounds it: each projection to
x's dtype, the activation to x's dtype, then the product (one launch instead of two GEMMs and an elementwise kernel).
linear_residual(x, weight, bias, residual) = residual + x·Wᵀ + b, the projection rounded before the add as torch
rounds it (a decoder layer's down projection and the residual add after it).

The Triton kernel runs up to `MAX_ROWS` rows of x (`ONE_WEIGHT_MAX_ROWS` for a single weight, unless the caller
says its one weight is several side by side); more rows go to cuBLAS (`torch.nn.functional.linear`) inside the same
op, gate and up as one GEMM where they lie back to back in one storage (`stacked`: a tensor-parallel model's shards,
`weights/packed_shards.py`). All are torch custom ops (`torch.library.custom_op`, shapes from a fake
implementation): a torch.compile'd layer calls them as opaque kernels, so the choice by row count makes no shape guard
(a guard crossed first while a CUDA graph is captured would recompile inside the capture).

Each program computes `BLOCK_N` output columns for every row (rows padded to a power of two of at least 16 for the
tensor cores) and streams its weight rows once; fp32 accumulation, fp32 inputs multiplied in IEEE fp32 (no TF32).
Outputs agree with `torch.nn.functional.linear` to the summation order.
"""

import functools

import torch
import torch.nn.functional as F

from . import TRITON_AVAILABLE, require_triton
from .compile_ahead import launch
from .dependent_launch import dependent_launch, launch_options
from .device_limits import fitting, shared_memory_limit, shrinking

MAX_ROWS = 64
ONE_WEIGHT_MAX_ROWS = 16  # one weight alone beats cuBLAS only up to here (H200: at 32 rows its down projection wins)
INVARIANT_BLOCK_M = 64  # `invariant` launches: rows in tiles of this many, whatever their count


def grouped_linear_reference(x: torch.Tensor, weights: list, biases: list) -> list:
    return [F.linear(x, w, b) for w, b in zip(weights, biases)]


def linear_residual_reference(x: torch.Tensor, weight: torch.Tensor, bias, residual: torch.Tensor) -> torch.Tensor:
    """residual + linear(x): a decoder layer's down projection and the residual add after it."""
    return residual + F.linear(x, weight, bias)


def gated_linear_reference(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """transformers' LlamaMLP / Qwen3MLP before its down projection, `act_fn` SiLU."""
    return F.silu(F.linear(x, gate)) * F.linear(x, up)


def stacked(tensors: list) -> torch.Tensor | None:
    """The tensors concatenated along their first dimension, as a view, where they lie back to back in one storage
    (contiguous, one dtype, device and trailing shape); else None."""
    first = tensors[0]
    end, storage = first.data_ptr(), first.untyped_storage().data_ptr()
    for t in tensors:
        if (t.data_ptr() != end or t.untyped_storage().data_ptr() != storage or not t.is_contiguous()
                or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]):
            return None
        end += t.numel() * t.element_size()
    return first.as_strided((sum(t.shape[0] for t in tensors), *first.shape[1:]), first.stride())


def _check(x: torch.Tensor, weights: list, biases: list) -> None:
    require_triton("skinny GEMMs")
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, in_features], got {list(x.shape)}")
    for w, b in zip(weights, biases):
        if w.dim() != 2 or w.shape[1] != x.shape[1] or w.dtype != x.dtype or not w.is_contiguous():
            raise ValueError(f"weights must be contiguous [out, {x.shape[1]}] in {x.dtype}, got {list(w.shape)} "
                             f"{w.dtype}")
        if b is not None and (b.shape != w.shape[:1] or b.dtype != x.dtype or not b.is_contiguous()):
            raise ValueError(f"biases must be contiguous [{w.shape[0]}] in {x.dtype}, got {list(b.shape)} "
                             f"{b.dtype}")


def _tiles(n_out: int, width: int, gated: bool, block_m: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, pipeline stages), from an H200 sweep at SDAR-4B's shapes (q/k/v and gate/up 3.0-3.9 TB/s
    at 4-16 rows against cuBLAS's 1.2-3.0, 2.6-3.5 at 32-64): 64 columns for wide outputs, long K steps for long rows,
    short ones when gated (two weight tiles in flight) or at 64 rows (shared memory). Tiles that timed 1.4-1.5x
    faster alone at tensor-parallel shards' widths made whole decode steps slower (docs/kernels.md, "Kernels and
    backends"), so these stay."""
    if gated:
        return (32 if block_m == 16 else 64), 128, 3
    block_k = 128 if block_m == 64 else 512 if width >= 4096 else 256
    return (64 if n_out > 4096 else 32), block_k, 4


def _shared_bytes(config: dict, block_m: int, gated: bool, element_size: int) -> int:
    """An upper bound of the shared memory Triton 3.9 gives the kernel: per pipeline stage an x tile
    [BLOCK_M, BLOCK_K] and a weight tile [BLOCK_N, BLOCK_K] (two when gated), num_stages of them, one more from 64
    rows on (compiled for sm_80, sm_86, sm_90 and sm_120: num_stages - 1 tile buffers, but num_stages + 1 from 64
    rows on sm_90, where the dot runs as Hopper's warp-group MMA)."""
    tiles = (block_m + config["BLOCK_N"] * (2 if gated else 1)) * config["BLOCK_K"] * element_size
    return (config["num_stages"] + (block_m >= 64)) * tiles


@functools.lru_cache(maxsize=None)
def _configs(n_out: int, width: int, gated: bool, block_m: int, element_size: int, limit: int | None) -> tuple:
    """The launch's candidate configurations (`device_limits`): `_tiles`' choice, then shorter K steps, fewer
    stages, fewer columns, those that fit `limit`."""
    block_n, block_k, stages = _tiles(n_out, width, gated, block_m)
    first = {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_stages": stages}
    candidates = shrinking(first, (("BLOCK_K", 32), ("num_stages", 2), ("BLOCK_N", 16)))
    return fitting(candidates, lambda config: _shared_bytes(config, block_m, gated, element_size), limit)


def kernel_takes(rows: int, invariant: bool, max_rows: int) -> bool:
    """Whether the Triton kernel runs a launch of `rows` rows (else cuBLAS, inside the same op)."""
    return invariant or rows <= max_rows


def grouped_linear(x: torch.Tensor, weights: list, biases: list, invariant: bool = False,
                   max_rows: int | None = None) -> list:
    """x [rows, K] and up to three weights [Nᵢ, K] (biases [Nᵢ] or None) → [rows, Nᵢ] each. `invariant`: a row's
    output does not depend on the rows beside it (the kernel at any row count, one tile configuration per weight
    shape; module docstring). `max_rows`: the most rows the kernel runs (default `MAX_ROWS`, `ONE_WEIGHT_MAX_ROWS`
    for one weight; a weight that is several side by side takes `MAX_ROWS`, as they would)."""
    if not 1 <= len(weights) <= 3 or len(biases) != len(weights):
        raise ValueError("grouped_linear takes one to three weights, and one bias (or None) for each")
    if any((b is None) != (biases[0] is None) for b in biases):
        raise ValueError("grouped_linear: give a bias for every weight or for none")
    _check(x, weights, biases)
    if max_rows is None:
        max_rows = MAX_ROWS if len(weights) > 1 else ONE_WEIGHT_MAX_ROWS
    return torch.ops.hf_blockdiff.grouped_linear(x.contiguous(), list(weights), list(biases), invariant, max_rows)


def linear_residual(x: torch.Tensor, weight: torch.Tensor, bias, residual: torch.Tensor,
                    invariant: bool = False) -> torch.Tensor:
    """x [rows, K], weight [N, K], bias [N] or None, residual [rows, N] → residual + x·Wᵀ + b, each sum rounded to
    x's dtype as torch rounds it (one launch instead of a projection and an add); `invariant` as `grouped_linear`."""
    _check(x, [weight], [bias])
    if residual.shape != (x.shape[0], weight.shape[0]) or residual.dtype != x.dtype:
        raise ValueError(f"residual must be [{x.shape[0]}, {weight.shape[0]}] in {x.dtype}, got "
                         f"{list(residual.shape)} {residual.dtype}")
    return torch.ops.hf_blockdiff.linear_residual(x.contiguous(), weight, bias, residual.contiguous(), invariant)


def linear_into(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, invariant: bool = False) -> None:
    """x [rows, K]·weightᵀ written into `out` [rows, N] (contiguous, x's dtype) by the kernel, whatever the rows. Not an
    op: for a caller inside an op of its own that has its output's memory (`weights/all_reduce.py` writes the product
    into the symmetric buffer the sum reads)."""
    require_triton("linear_into")
    _check(x, [weight], [None])
    if out.shape != (x.shape[0], weight.shape[0]) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{x.shape[0]}, {weight.shape[0]}] {x.dtype} tensor, got "
                         f"{list(out.shape)} {out.dtype}")
    _launch(x.contiguous(), [weight], [None], [out], False, invariant)


def gated_linear(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """x [rows, K], gate and up [N, K] → silu(x·gateᵀ)·(x·upᵀ) [rows, N]; `invariant` as `grouped_linear`."""
    _check(x, [gate, up], [None, None])
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have one shape, got {list(gate.shape)} and {list(up.shape)}")
    return torch.ops.hf_blockdiff.gated_linear(x.contiguous(), gate, up, invariant)


if TRITON_AVAILABLE:
    import triton
    import triton.language as tl
    from torch.library import custom_op

    from .dependent_launch import allow_dependents, wait_inputs
    from .rounding import dot_t, ieee_products, round_to

    @triton.jit
    def _store(acc, acc_up, b_ptr, r_ptr, y_ptr, cols, rm, rows, n, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
               HAS_RESIDUAL: tl.constexpr):
        """The epilogue: SiLU·up (GATED) or + bias, rounded to y's dtype, then + residual, rounded again."""
        dtype = y_ptr.dtype.element_ty
        if GATED:
            gate = round_to(acc, dtype)
            out = round_to(gate / (1.0 + tl.exp(-gate)), dtype) * round_to(acc_up, dtype)
        else:
            out = acc
            if HAS_BIAS:
                out += tl.load(b_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
        y_mask = (rm[:, None] < rows) & (cols[None, :] < n)
        out = round_to(out, dtype)
        if HAS_RESIDUAL:
            residual = tl.load(r_ptr + rm[:, None].to(tl.int64) * n + cols[None, :], mask=y_mask, other=0.0)
            out = round_to(out + residual.to(tl.float32), dtype)
        tl.store(y_ptr + rm[:, None].to(tl.int64) * n + cols[None, :], out.to(dtype), mask=y_mask)

    @triton.jit
    def _x_tile(x_ptr, rm, ks, rows, K):
        return tl.load(x_ptr + rm[:, None] * K + ks[None, :], mask=(rm[:, None] < rows) & (ks[None, :] < K), other=0.0)

    # variants follow only the tile sizes (BLOCK_M 16/32/64), not every row count, and every capacity runs once
    # before its CUDA graph is captured, so none compiles mid-capture; x is made 16-byte aligned in `_launch`, so its
    # alignment specialization never changes either (left unspecialized, its loads made a batch-1 step 25 % slower
    # on an H200)
    @triton.jit(do_not_specialize=["rows"])
    def _skinny_kernel(x_ptr, w0, w1, w2, b0, b1, b2, y0, y1, y2, r_ptr, n0, n1, n2, rows, K,
                       HAS_BIAS: tl.constexpr, GATED: tl.constexpr, IEEE: tl.constexpr, GDC: tl.constexpr,
                       HAS_RESIDUAL: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # program → (weight, column tile) × row tile; GATED: every program reads the same columns of w0 (gate) and
        # w1 (up)
        allow_dependents(GDC)
        pid = tl.program_id(0)
        tiles0 = tl.cdiv(n0, BLOCK_N)
        tiles1 = tl.cdiv(n1, BLOCK_N)
        w_ptr = w0
        b_ptr = b0
        y_ptr = y0
        n = n0
        tile = pid
        if not GATED:
            if pid >= tiles0 + tiles1:
                w_ptr = w2
                b_ptr = b2
                y_ptr = y2
                n = n2
                tile = pid - tiles0 - tiles1
            elif pid >= tiles0:
                w_ptr = w1
                b_ptr = b1
                y_ptr = y1
                n = n1
                tile = pid - tiles0
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        w_offsets = cols[:, None].to(tl.int64) * K + rk[None, :]
        w_mask = (cols[:, None] < n) & (rk[None, :] < K)
        # the first weight tiles are read before waiting for x (the previous kernel's output)
        w = tl.load(w_ptr + w_offsets, mask=w_mask, other=0.0)
        u = w
        if GATED:
            u = tl.load(w1 + w_offsets, mask=w_mask, other=0.0)
        wait_inputs(GDC)
        x = _x_tile(x_ptr, rm, rk, rows, K)
        acc = dot_t(x, w, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE)
        acc_up = acc
        if GATED:
            acc_up = dot_t(x, u, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            ks = k0 + rk
            x = _x_tile(x_ptr, rm, ks, rows, K)
            w_mask = (cols[:, None] < n) & (ks[None, :] < K)
            acc = dot_t(x, tl.load(w_ptr + w_offsets + k0, mask=w_mask, other=0.0), acc, IEEE)
            if GATED:
                acc_up = dot_t(x, tl.load(w1 + w_offsets + k0, mask=w_mask, other=0.0), acc_up, IEEE)
        _store(acc, acc_up, b_ptr, r_ptr, y_ptr, cols, rm, rows, n, HAS_BIAS, GATED, HAS_RESIDUAL)

    def _launch(x, weights, biases, outputs, gated, invariant, residual=None, configs=None):
        """The kernel with the first of `configs` that loads (None: `device_configs`', the tile sweep
        benchmarks/skinny_tiles.py names its own), over the row tiles of `_block_m`."""
        if x.data_ptr() % 16:
            x = x.clone()
        rows, width = x.shape
        widths = tuple(w.shape[0] for w in weights) + (0,) * (3 - len(weights))
        has_bias = biases[0] is not None
        block_m = _block_m(rows, invariant)
        configs = configs or device_configs(x, widths, gated, invariant)
        overlap = dependent_launch(x.device)
        launch(_skinny_kernel, lambda config: (_programs(widths, gated, config["BLOCK_N"]), triton.cdiv(rows, block_m)),
            x, *_three(weights), *_three(biases if has_bias else weights), *_three(outputs),
            outputs[0] if residual is None else residual, *widths, rows, width,
            HAS_BIAS=has_bias, GATED=gated, IEEE=ieee_products(x.dtype), GDC=overlap,
            HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, num_warps=4, configs=configs,
            **launch_options(overlap),
        )

    def device_configs(x: torch.Tensor, widths: tuple, gated: bool, invariant: bool = False) -> tuple:
        """The candidate configurations of a launch on x's rows and device for weights of `widths` output columns
        (three, zeros for unused slots; gated: gate's and up's)."""
        block_m = _block_m(x.shape[0], invariant)
        return _configs(sum(widths), x.shape[1], gated, block_m, x.element_size(), shared_memory_limit(x.device))

    def _block_m(rows: int, invariant: bool) -> int:
        """Rows per tile: all of them in one tile padded to a power of two of at least 16 (MAX_ROWS at most), or
        `INVARIANT_BLOCK_M` whatever the rows (Triton may pick another MMA instruction for another BLOCK_M)."""
        return INVARIANT_BLOCK_M if invariant else max(16, triton.next_power_of_2(rows))

    def _programs(widths: tuple, gated: bool, block_n: int) -> int:
        """Column tiles: of the gate's columns (up's are the same) when gated, else of every weight's."""
        return triton.cdiv(widths[0], block_n) if gated else sum(triton.cdiv(n, block_n) for n in widths)

    def _three(tensors: list) -> list:
        """The kernel's three slots; unused ones repeat the first tensor (their width is 0: no program reads them)."""
        return list(tensors) + [tensors[0]] * (3 - len(tensors))

    @custom_op("hf_blockdiff::grouped_linear", mutates_args=())
    def _grouped_linear_op(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None],
                           invariant: bool, max_rows: int) -> list[torch.Tensor]:
        if not kernel_takes(x.shape[0], invariant, max_rows):
            return grouped_linear_reference(x, weights, biases)
        outputs = [x.new_empty(x.shape[0], w.shape[0]) for w in weights]
        _launch(x, weights, biases, outputs, False, invariant)
        return outputs

    @_grouped_linear_op.register_fake
    def _grouped_linear_shapes(x, weights, biases, invariant, max_rows):
        """Shapes only: tracing never runs the kernel (nor Triton's CPU interpreter)."""
        return [x.new_empty(x.shape[0], w.shape[0]) for w in weights]

    @custom_op("hf_blockdiff::linear_residual", mutates_args=())
    def _linear_residual_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            residual: torch.Tensor, invariant: bool) -> torch.Tensor:
        if not kernel_takes(x.shape[0], invariant, ONE_WEIGHT_MAX_ROWS):
            return linear_residual_reference(x, weight, bias, residual)
        out = torch.empty_like(residual)
        _launch(x, [weight], [bias], [out], False, invariant, residual=residual)
        return out

    @_linear_residual_op.register_fake
    def _linear_residual_shape(x, weight, bias, residual, invariant):
        return torch.empty_like(residual)

    @custom_op("hf_blockdiff::gated_linear", mutates_args=())
    def _gated_linear_op(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, invariant: bool) -> torch.Tensor:
        if not kernel_takes(x.shape[0], invariant, MAX_ROWS):
            both = stacked([gate, up])
            if both is None:
                return gated_linear_reference(x, gate, up)
            gated, product = F.linear(x, both).split(gate.shape[0], dim=1)
            return F.silu(gated) * product
        out = x.new_empty(x.shape[0], gate.shape[0])
        _launch(x, [gate, up], [None, None], [out], True, invariant)
        return out

    @_gated_linear_op.register_fake
    def _gated_linear_shapes(x, gate, up, invariant):
        return x.new_empty(x.shape[0], gate.shape[0])
