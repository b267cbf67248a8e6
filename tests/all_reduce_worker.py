"""Run by test_distributed under `torchrun --nproc_per_node 2` on two GPUs (NCCL): `partial_sums` (weights/all_reduce.py)
summing many different messages back to back, eagerly and replayed from CUDA graphs, rank 1's memory kept busy by
copies on another stream so its sums read late; every sum is checked exactly (small integers in fp32), and the first
process writes the kinds of sum it used and the wrong sums it found as JSON (OUTPUT)."""

import json
import os
import sys

import torch
import torch.distributed as dist

from hf_blockdiff.weights.all_reduce import BACKEND_BYTES, TWO_SHOT_BYTES, kind_of, partial_sums, sums_for

CALLS, REPLAYS = 48, 20
WIDTHS = (BACKEND_BYTES // 4, BACKEND_BYTES // 4 + 4, TWO_SHOT_BYTES // 4)  # fp32 elements: NCCL, two-shot, two-shot


def messages(rank: int, width: int, device) -> torch.Tensor:
    """CALLS messages of this rank, each different: small integers, whose fp32 sums are exact in any order."""
    g = torch.Generator().manual_seed(1000 * rank + width)
    return torch.randint(-64, 64, (CALLS, width), generator=g).float().to(device)


def summed(xs: torch.Tensor, name: str) -> list[torch.Tensor]:
    """Every message summed, call after call, as a forward does."""
    return [partial_sums(x, name) for x in xs]


def wrong(outs: list[torch.Tensor], want: torch.Tensor) -> int:
    return sum(int(not torch.equal(out, expected)) for out, expected in zip(outs, want))


def contend(rank: int, busy: torch.cuda.Stream, scratch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """On rank 1, copies of 256 MB on another stream, beside the sums enqueued next."""
    if rank == 1:
        with torch.cuda.stream(busy):
            for _ in range(16):
                scratch[0].copy_(scratch[1])


def check(width: int, name: str, rank: int, device) -> dict:
    xs = messages(rank, width, device)
    want = sum(messages(r, width, device) for r in range(dist.get_world_size()))
    busy, scratch = torch.cuda.Stream(), (torch.empty(2**26, device=device), torch.ones(2**26, device=device))
    contend(rank, busy, scratch)
    eager = wrong(summed(xs, name), want)
    torch.cuda.synchronize()
    graph, outs = torch.cuda.CUDAGraph(), None
    with torch.cuda.graph(graph):
        outs = summed(xs, name)
    replays = 0
    for _ in range(REPLAYS):
        for out in outs:
            out.zero_()
        contend(rank, busy, scratch)
        graph.replay()
        torch.cuda.synchronize()
        replays += wrong(outs, want)
    return {"kind": kind_of(width * 4, torch.float32, True), "eager": eager, "replays": replays}


def main(output: str) -> None:
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    name = sums_for(dist.group.WORLD)
    report = {str(width): check(width, name, rank, device) for width in WIDTHS}
    if rank == 0:
        with open(output, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
