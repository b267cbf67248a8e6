"""CUDA graphs of the decode step: one graph per chunk-capacity bucket, captured lazily, replayed while the engine
lives on the model (reused across calls, dropped by `free_cache`).

A step (`Decoder.advance` with fixed capacities) has static shapes and no host sync, and it prepares its successor
into fixed buffers, so one replay runs forward, scoring, strategy, canvas and state updates as one GPU program. The
host reads back the next step's chunk count (with the done flags) to pick the bucket. Off CUDA the same fixed-shape
step runs eagerly, which is how the CPU tests check it against the exactly-sized step.
"""

from __future__ import annotations

import torch

from .loop import Decoder


def capacity_buckets(slots: int, most: int) -> list[int]:
    """Chunk capacities from `slots` up to `most`: every count for small batches, eighths of `slots` above."""
    step = max(1, slots // 8)
    buckets = list(range(slots, most + step, step))
    return sorted({min(b, most) for b in buckets} | {most})


class StepGraphs:
    def __init__(self, decoder: Decoder, capture: bool):
        state = decoder.state
        self.decoder, self.capture = decoder, capture
        self.logit_capacity = state.num_rows * decoder.active_blocks * state.block_size
        most = state.num_rows * -(-(state.width + 1) // decoder.chunk)
        self.buckets = capacity_buckets(state.num_rows, most)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def step(self) -> None:
        total = int(self.decoder.chunk_total)
        capacity = next(b for b in self.buckets if b >= total)
        graph = self.graphs.get(capacity)
        if graph is not None:
            graph.replay()
            return
        self.decoder.advance(capacity, self.logit_capacity)  # a real step, which also warms this shape up
        if self.capture:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.decoder.advance(capacity, self.logit_capacity)
            self.graphs[capacity] = graph
