"""How many splits of the key range paged attention should take at decode shapes: `python3 benchmarks/attention_splits.py`
(from the repository root, on a GPU) times `paged_attention` at every split count beside the automatic choice
(`_auto_splits`), for chunks of 4 queries per slot (block 4) over a range of slots, KV heads and prefix lengths; GPU
time per call under a CUDA graph of 36 calls (one per layer), microseconds."""

import argparse

import torch

from hf_blockdiff.kernels import paged_attention as module

parser = argparse.ArgumentParser()
parser.add_argument("--kv-heads", default="4,8", help="KV heads per GPU (comma-separated)")
parser.add_argument("--slots", default="8,16,24,32")
parser.add_argument("--keys", default="300:512,800:1024,3500:4096", help="keys:capacity pairs (capacity: the page "
                    "table's span, which the splits divide)")
parser.add_argument("--group", type=int, default=4, help="query heads per KV head")
parser.add_argument("--head-dim", type=int, default=128)
parser.add_argument("--splits", default="1,2,3,4")
PAGE, QUERIES, LAYERS = 64, 4, 36


def graph_time(fn) -> float:
    """Microseconds per call of `fn`, replayed in a CUDA graph of LAYERS calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / 20 / LAYERS


def row(kv_heads: int, slots: int, keys: int, capacity: int, args) -> str:
    device, dim = torch.device("cuda"), args.head_dim
    q = torch.randn(slots, kv_heads * args.group, QUERIES, dim, device=device, dtype=torch.bfloat16)
    pages = slots * capacity // PAGE
    k = torch.randn(pages, PAGE, kv_heads, dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.arange(pages, device=device, dtype=torch.int32).view(slots, capacity // PAGE)
    limits = torch.full((slots, QUERIES), keys + QUERIES, device=device, dtype=torch.int32)
    auto = module._auto_splits(slots * kv_heads, args.group * QUERIES, dim, capacity, device)
    counts = sorted({auto, *map(int, args.splits.split(","))})
    times = {n: graph_time(lambda n=n: module.paged_attention(q, k, v, table, limits, dim**-0.5, num_splits=n))
             for n in counts}
    best = min(times, key=times.get)
    cells = " | ".join(f"{times[n]:.1f}" for n in counts)
    return (f"| {kv_heads} | {slots} | {slots * kv_heads} | {keys} / {capacity} | {auto}: {times[auto]:.1f} | "
            f"{best}: {times[best]:.1f} | {cells} ({', '.join(map(str, counts))}) |")


def main() -> None:
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name()}, {module._sm_count(torch.cuda.current_device())} SMs")
    print("| KV heads | slots | programs | keys / capacity | automatic: us | fastest: us | every count |")
    print("|---|---|---|---|---|---|---|")
    for kv_heads in map(int, args.kv_heads.split(",")):
        for slots in map(int, args.slots.split(",")):
            for pair in args.keys.split(","):
                keys, capacity = map(int, pair.split(":"))
                print(row(kv_heads, slots, keys, capacity, args), flush=True)


if __name__ == "__main__":
    main()
