"""CUDA graphs of the decode step: one graph per chunk-capacity bucket, captured lazily, replayed while the engine
lives on the model (reused across calls, dropped by `free_cache`).

A step (`DecodeStep` with fixed capacities) has static shapes and no host sync, and it prepares its successor
into fixed buffers, so one replay runs forward, scoring, strategy, canvas and state updates as one GPU program. The
host reads back the next step's chunk count (with the done flags) to pick the bucket. Where a mode bounds every
window (single-block block-causal decoding) and the bound is a small forward, whose cost hardly depends on its token
count, one graph chains `CHAIN_STEPS` steps at the bound with no host round trip between them. Off CUDA the same
fixed-shape steps run eagerly, which is how the CPU tests check them against the exactly-sized step.
"""

from __future__ import annotations

import torch

from .step import DecodeStep

CHAIN_STEPS = 8
SMALL_FORWARD_TOKENS = 64  # up to here a forward reads the weights once however many tokens it holds


def capacity_buckets(slots: int, most: int) -> list[int]:
    """Chunk capacities from `slots` up to `most`: every count for small batches, eighths of `slots` above."""
    step = max(1, slots // 8)
    buckets = list(range(slots, most + step, step))
    return sorted({min(b, most) for b in buckets} | {most})


class StepGraphs:
    def __init__(self, step: DecodeStep, capture: bool):
        scheduler = step.scheduler
        state = scheduler.state
        self.decode_step, self.scheduler, self.capture = step, scheduler, capture
        self.logit_capacity = state.num_rows * scheduler.active_blocks * state.block_size
        most = state.num_rows * -(-(state.width + 1) // scheduler.chunk)
        self.buckets = capacity_buckets(state.num_rows, most)
        bound = scheduler.chunk_bound()
        small = bound is not None and state.num_rows * bound * scheduler.chunk <= SMALL_FORWARD_TOKENS
        self.chain_capacity = state.num_rows * bound if small else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def step(self) -> None:
        """One replay: a chain of steps at the bound, or one step in the bucket of its chunk count."""
        if self.chain_capacity is not None:
            capacity, steps = self.chain_capacity, CHAIN_STEPS
        else:
            total = int(self.scheduler.chunk_total)
            capacity, steps = next(b for b in self.buckets if b >= total), 1
        graph = self.graphs.get(capacity)
        if graph is not None:
            graph.replay()
            return
        for _ in range(steps):  # real steps, which also warm this shape up
            self.decode_step(capacity, self.logit_capacity)
        if self.capture:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                for _ in range(steps):
                    self.decode_step(capacity, self.logit_capacity)
            self.graphs[capacity] = graph
