"""Run by test_distributed under `torchrun --nproc_per_node 2` on two GPUs (NCCL): `row_parallel_linear`
(weights/all_reduce.py) summing many different products back to back, alone, with a residual added and with the
post-attention RMSNorm after (`row_parallel_linear_norm`), eagerly and replayed from CUDA graphs, rank 1's memory kept
busy by copies on another stream so its sums read late; every sum is checked exactly (products of small integers in
fp32, the residual too), every norm against torch's of the exact sum, and the first process writes the kinds of sum
it used and the wrong results it found as JSON (OUTPUT)."""

import json
import os
import sys

import torch
import torch.distributed as dist

from hf_blockdiff.kernels.rmsnorm import rms_norm_reference
from hf_blockdiff.weights.all_reduce import (_SUMS, ONE_SHOT_BYTES, TWO_SHOT_BYTES, row_parallel_linear,
                                             row_parallel_linear_norm, sums_for)

CALLS, REPLAYS, K = 48, 20, 16
# (rows, width, skinny) of fp32 products: the one-shot kernel at a batch-1 step's rows (cuBLAS's product and the skinny
# GEMM's, pushed into the slots) and at its largest, two-shot at its smallest (the skinny GEMM writing into the
# buffer) and its largest (cuBLAS's), NCCL beyond the buffer (cuBLAS's product summed in place)
CASES = ((4, 4096, False), (4, 4096, True), (16, ONE_SHOT_BYTES // 64, True), (16, ONE_SHOT_BYTES // 64 + 8, True),
         (512, TWO_SHOT_BYTES // 2048, False), (512, TWO_SHOT_BYTES // 2048 + 8, False))
VARIANTS = ("sum", "residual", "norm")  # the op alone, with the residual stream added, with the norm after
EPS = 1e-6


def operands(rank: int, rows: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """CALLS inputs [rows, K] of this rank, each different, and its weight [width, K]: small integers, whose fp32
    products and sums are exact in any order."""
    g = torch.Generator().manual_seed(1000 * rank + rows + width)
    xs = torch.randint(-8, 8, (CALLS, rows, K), generator=g).float()
    return xs.to(device), torch.randint(-8, 8, (width, K), generator=g).float().to(device)


def summed(xs: torch.Tensor, weight: torch.Tensor, name: str, skinny: bool, variant: str,
           residuals: torch.Tensor) -> list:
    """Every product summed, call after call, as a forward does: the sum, or (residual +) sum, or that and its norm
    (norm weight 1 + the position / width)."""
    if variant == "norm":
        norm = 1 + torch.arange(weight.shape[0], device=weight.device) / weight.shape[0]
        return [row_parallel_linear_norm(x, weight, name, skinny, False, r, norm, EPS) for x, r in zip(xs, residuals)]
    return [row_parallel_linear(x, weight, name, skinny, False, r if variant == "residual" else None)
            for x, r in zip(xs, residuals)]


def wrong(outs: list, want: torch.Tensor, variant: str) -> int:
    """Sums not exactly `want`; norms (hidden, normed) whose hidden is not or whose norm is not torch's of `want`."""
    if variant != "norm":
        return sum(int(not torch.equal(out, expected)) for out, expected in zip(outs, want))
    norm = 1 + torch.arange(want.shape[-1], device=want.device) / want.shape[-1]
    return sum(int(not torch.equal(hidden, expected) or not torch.allclose(
        normed, rms_norm_reference(expected, norm, EPS), rtol=1e-5, atol=1e-5)) for (hidden, normed), expected in
        zip(outs, want))


def contend(rank: int, busy: torch.cuda.Stream, scratch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """On rank 1, copies of 256 MB on another stream, beside the sums enqueued next."""
    if rank == 1:
        with torch.cuda.stream(busy):
            for _ in range(16):
                scratch[0].copy_(scratch[1])


def check(rows: int, width: int, skinny: bool, variant: str, name: str, rank: int, device) -> dict:
    xs, weight = operands(rank, rows, width, device)
    residuals = torch.randint(-8, 8, (CALLS, rows, width), generator=torch.Generator().manual_seed(width)).float()
    residuals = residuals.to(device)  # the residual stream: the same on every rank
    want = sum(x @ w.T for x, w in (operands(r, rows, width, device) for r in range(dist.get_world_size())))
    want = want if variant == "sum" else want + residuals
    busy, scratch = torch.cuda.Stream(), (torch.empty(2**26, device=device), torch.ones(2**26, device=device))
    contend(rank, busy, scratch)
    eager = wrong(summed(xs, weight, name, skinny, variant, residuals), want, variant)
    torch.cuda.synchronize()
    graph, outs = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        outs = summed(xs, weight, name, skinny, variant, residuals)
    replays = 0
    for _ in range(REPLAYS):
        for out in outs:
            for tensor in (out if variant == "norm" else [out]):
                tensor.zero_()
        contend(rank, busy, scratch)
        graph.replay()
        torch.cuda.synchronize()
        replays += wrong(outs, want, variant)
    return {"kind": _SUMS[name].kind(rows, width, torch.float32), "eager": eager, "replays": replays}


def main(output: str) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    name = sums_for(dist.group.WORLD)
    report = {f"{rows}x{width} {variant}": check(rows, width, skinny, variant, name, rank, device)
              for rows, width, skinny in CASES for variant in VARIANTS}
    if rank == 0:
        with open(output, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
