"""How long one small all-reduce takes inside a CUDA graph, as a tensor-parallel decode step issues them (two per
decoder layer): `torchrun --nproc_per_node 2 benchmarks/allreduce_latency.py` prints, per message size, the mean
time of NCCL's all-reduce and of torch's symmetric-memory one-shot and two-shot all-reduces (NVLink loads and stores,
no multicast; the op does not take torch's one-shot kernel, which summed wrong under load), and of the library's ops
(`weights/all_reduce.py`'s `row_parallel_linear`: a product of K=16 written where the kernel it picks for the size
reads it, then summed: our fenced one-shot kernel up to 256 KB; and `row_parallel_linear_norm`, with the residual
added and the RMSNorm after), each replayed from a graph of 64 back-to-back calls (docs/benchmarks.md, "Tensor
parallel")."""

import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from hf_blockdiff.weights.all_reduce import _SUMS, row_parallel_linear, row_parallel_linear_norm, sums_for

CALLS, REPLAYS, WIDTH, K = 64, 20, 4096, 16
SIZES_KB = (8, 32, 128, 256, 512, 2048)


def timed(fn) -> float:
    """Mean microseconds of one `fn()` replayed from a graph of CALLS calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (REPLAYS * CALLS)


def main():
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    group = dist.group.WORLD.group_name
    ours = sums_for(dist.group.WORLD)
    buffer = symm_mem.empty(max(SIZES_KB) * 1024 // 2, dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(buffer, group)
    rows = []
    for kb in SIZES_KB:
        x = torch.randn(kb * 1024 // 2, dtype=torch.bfloat16, device="cuda")
        want = x.float() * 0
        for r in range(dist.get_world_size()):
            other = x.clone()
            dist.broadcast(other, r)
            want += other.float()
        one = torch.ops.symm_mem.one_shot_all_reduce_copy(buffer[: x.numel()], x, "sum", group)
        view = buffer[: x.numel()]
        view.copy_(x)
        two = torch.empty_like(x)
        torch.ops.symm_mem.two_shot_all_reduce_out(view, "sum", group, two)
        factors = torch.randn(x.numel() // WIDTH, K, dtype=x.dtype, device="cuda"), torch.randn(
            WIDTH, K, dtype=x.dtype, device="cuda")
        mine, product = row_parallel_linear(*factors, ours, False, False), factors[0] @ factors[1].T
        dist.all_reduce(product)
        ok = all(torch.allclose(y.float(), want, atol=0.1, rtol=0.02) for y in (one, two)) and torch.allclose(
            mine.float(), product.float(), atol=0.1, rtol=0.02)
        nccl = timed(lambda: dist.all_reduce(x.clone()))
        one_shot = timed(lambda: torch.ops.symm_mem.one_shot_all_reduce_copy(view, x, "sum", group))

        def two():
            view.copy_(x)
            torch.ops.symm_mem.two_shot_all_reduce_(view, "sum", group)
        two_shot = timed(two)
        op = timed(lambda: row_parallel_linear(*factors, ours, False, False))
        residual, norm = torch.randn_like(product), torch.ones(WIDTH, dtype=x.dtype, device="cuda")
        op_norm = timed(lambda: row_parallel_linear_norm(*factors, ours, False, False, residual, norm, 1e-6))
        kind = _SUMS[ours].kind(x.numel() // WIDTH, WIDTH, x.dtype)  # the path the op took
        rows.append(f"| {kb} KB | {nccl:.1f} | {one_shot:.1f} | {two_shot:.1f} | {op:.1f} ({kind}) | {op_norm:.1f} "
                    f"| {ok} |")
    if rank == 0:
        print(f"{dist.get_world_size()} x {torch.cuda.get_device_name()}, torch {torch.__version__}")
        print("| message | NCCL (us) | symm one-shot (us) | symm two-shot (us) | row_parallel_linear (us) "
              "| with residual and norm (us) | sums right |")
        print("|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
