"""Run by test_distributed under `torchrun --nproc_per_node 2` on two GPUs (NCCL): `row_parallel_linear`
(weights/all_reduce.py) summing many different products back to back, eagerly and replayed from CUDA graphs, rank 1's
memory kept busy by copies on another stream so its sums read late; every sum is checked exactly (products of small
integers in fp32), and the first process writes the kinds of sum it used and the wrong sums it found as JSON
(OUTPUT)."""

import json
import os
import sys

import torch
import torch.distributed as dist

from hf_blockdiff.weights.all_reduce import BACKEND_BYTES, TWO_SHOT_BYTES, kind_of, row_parallel_linear, sums_for

CALLS, REPLAYS, K = 48, 20, 16
# (rows, width, skinny) of fp32 products: NCCL at its largest (the skinny GEMM's product summed in place), two-shot
# at its smallest (the skinny GEMM's product copied into the buffer) and its largest (cuBLAS writing into it)
CASES = ((16, BACKEND_BYTES // 64, True), (16, BACKEND_BYTES // 64 + 8, True), (512, TWO_SHOT_BYTES // 2048, False))


def operands(rank: int, rows: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """CALLS inputs [rows, K] of this rank, each different, and its weight [width, K]: small integers, whose fp32
    products and sums are exact in any order."""
    g = torch.Generator().manual_seed(1000 * rank + rows + width)
    xs = torch.randint(-8, 8, (CALLS, rows, K), generator=g).float()
    return xs.to(device), torch.randint(-8, 8, (width, K), generator=g).float().to(device)


def summed(xs: torch.Tensor, weight: torch.Tensor, name: str, skinny: bool) -> list[torch.Tensor]:
    """Every product summed, call after call, as a forward does."""
    return [row_parallel_linear(x, weight, name, skinny, False) for x in xs]


def wrong(outs: list[torch.Tensor], want: torch.Tensor) -> int:
    return sum(int(not torch.equal(out, expected)) for out, expected in zip(outs, want))


def contend(rank: int, busy: torch.cuda.Stream, scratch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """On rank 1, copies of 256 MB on another stream, beside the sums enqueued next."""
    if rank == 1:
        with torch.cuda.stream(busy):
            for _ in range(16):
                scratch[0].copy_(scratch[1])


def check(rows: int, width: int, skinny: bool, name: str, rank: int, device) -> dict:
    xs, weight = operands(rank, rows, width, device)
    want = sum(x @ w.T for x, w in (operands(r, rows, width, device) for r in range(dist.get_world_size())))
    busy, scratch = torch.cuda.Stream(), (torch.empty(2**26, device=device), torch.ones(2**26, device=device))
    contend(rank, busy, scratch)
    eager = wrong(summed(xs, weight, name, skinny), want)
    torch.cuda.synchronize()
    graph, outs = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        outs = summed(xs, weight, name, skinny)
    replays = 0
    for _ in range(REPLAYS):
        for out in outs:
            out.zero_()
        contend(rank, busy, scratch)
        graph.replay()
        torch.cuda.synchronize()
        replays += wrong(outs, want)
    return {"kind": kind_of(rows * width * 4, torch.float32, True), "eager": eager, "replays": replays}


def main(output: str) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    name = sums_for(dist.group.WORLD)
    report = {f"{rows}x{width}": check(rows, width, skinny, name, rank, device) for rows, width, skinny in CASES}
    if rank == 0:
        with open(output, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
