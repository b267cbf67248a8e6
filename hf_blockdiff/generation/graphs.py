"""CUDA graphs of the decode step: one graph per chunk-capacity bucket, captured lazily, replayed while the engine
lives on the model (reused across calls, dropped by `free_cache`).

A step (`DecodeStep` with fixed capacities) has static shapes and no host sync, and it prepares its successor
into fixed buffers, so one replay runs forward, scoring, strategy, canvas and state updates as one GPU program. The
host reads back the next step's chunk count (with the done flags) to pick the bucket. Where a mode bounds every
window (single-block block-causal decoding) and the bound is a small forward, whose cost hardly depends on its token
count, one graph chains `CHAIN_STEPS` steps at the bound with no host round trip between them. Off CUDA the same
fixed-shape steps run eagerly, which is how the CPU tests check them against the exactly-sized step.

Before the first step of a graphed engine whose layers are not torch.compile'd, `compile_ahead` compiles the step's
Triton kernels in parallel (a cold process's first call: docs/benchmarks.md, "Cold start").

Every capture runs with Python's cyclic garbage collector paused (`capturing`): torch no longer collects before a
capture (`torch.compiler.config.force_cudagraph_gc` is off by default), so a collection that happens to start inside
one can free an earlier engine's graphs, and their reset (freeing graph memory) is an operation a capture forbids:
the capture fails with "operation failed due to a previous error during capture".
"""

from __future__ import annotations

import gc
import os
import threading
from contextlib import contextmanager
from typing import Callable

import torch

from ..cache import PagedBlockCache
from ..fusion.compile_worker import WORKER
from ..kernels.compile_ahead import can_compile_ahead, compiling_ahead
from .step import DecodeStep

CHAIN_STEPS = 8
SMALL_FORWARD_TOKENS = 64  # up to here a forward reads the weights once however many tokens it holds


def capacity_buckets(slots: int, most: int) -> list[int]:
    """Chunk capacities from `slots` up to `most`: every count for small batches, eighths of `slots` above."""
    step = max(1, slots // 8)
    buckets = list(range(slots, most + step, step))
    return sorted({min(b, most) for b in buckets} | {most})


_GC_LOCK = threading.Lock()
_GC_PAUSES = [0, False]  # captures under way in this process; whether the collector was on before the first


def _forked_child() -> None:
    """A fork taken while another thread captured: the child captures nothing (threads do not survive a fork), so its
    collector goes back to how it was, and the lock that thread may have held is a new one."""
    global _GC_LOCK
    _GC_LOCK = threading.Lock()
    if _GC_PAUSES[0] and _GC_PAUSES[1]:
        gc.enable()
    _GC_PAUSES[:] = [0, False]


os.register_at_fork(after_in_child=_forked_child)


@contextmanager
def paused_gc():
    """Python's cyclic garbage collector off inside (nested and across threads: on again, if it was, when the last
    one leaves)."""
    with _GC_LOCK:
        if _GC_PAUSES[0] == 0:
            _GC_PAUSES[1] = gc.isenabled()
            gc.disable()
        _GC_PAUSES[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_PAUSES[0] -= 1
            if _GC_PAUSES[0] == 0 and _GC_PAUSES[1]:
                gc.enable()


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, **kwargs):
    """`torch.cuda.graph(graph, **kwargs)` with the garbage collector paused (module docstring)."""
    with paused_gc(), torch.cuda.graph(graph, **kwargs):
        yield


def compile_ahead(program: Callable[[], None], device: torch.device, cache: PagedBlockCache, fusion: str) -> None:
    """Compile the Triton kernels `program` launches, in parallel, without running it: inside
    `kernels.compile_ahead.compiling_ahead` it is captured into a graph that is thrown away, so nothing it enqueues
    runs (its writes included). Only for programs a graph may capture. Skipped where capturing would compile (fusion
    "compile": torch.compile'd layers compile, and autotune, at their first call), and unless every layer of `cache`
    has its pools (one allocated inside the thrown-away graph would keep its zeros unwritten)."""
    if fusion == "compile" or not (cache.fully_allocated and can_compile_ahead(device)):
        return
    with compiling_ahead(device):
        graph = torch.cuda.CUDAGraph()
        # relaxed: the program may meet an op for the first time here (the real capture comes after eager steps),
        # whose lazy set-up (cuBLAS's, ...) makes calls a stricter capture refuses; this graph is never replayed
        with capturing(graph, capture_error_mode="relaxed"):
            program()


class StepGraphs:
    def __init__(self, step: DecodeStep, capture: bool, fusion: str = "none"):
        """`fusion`: the layers' (`fusion.fusion_for`), which says whether the first capture may compile ahead."""
        scheduler = step.scheduler
        state = scheduler.state
        self.decode_step, self.scheduler, self.capture, self.fusion = step, scheduler, capture, fusion
        self.ahead = capture  # until the first step: `compile_ahead`
        self.logit_capacity = state.num_rows * scheduler.active_blocks * state.block_size
        most = state.num_rows * -(-(state.width + 1) // scheduler.chunk)
        self.buckets = capacity_buckets(state.num_rows, most)
        bound = scheduler.chunk_bound()
        small = bound is not None and state.num_rows * bound * scheduler.chunk <= SMALL_FORWARD_TOKENS
        self.chain_capacity = state.num_rows * bound if small else None
        self._forget_graphs()

    def _forget_graphs(self) -> None:
        """No graph captured yet, a pool of their own (a capture must not reuse one no graph holds any more), and the
        compile worker's finished jobs as of now."""
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.landed = WORKER.landed

    def step(self) -> None:
        """One replay: a chain of steps at the bound, or one step in the bucket of its chunk count. Graphs captured
        before the compile worker finished a job hold what ran eager until then: they are captured again."""
        if self.landed != WORKER.landed:
            self._forget_graphs()
        if self.chain_capacity is not None:
            capacity, steps = self.chain_capacity, CHAIN_STEPS
        else:
            total = int(self.scheduler.chunk_total)
            capacity, steps = next(b for b in self.buckets if b >= total), 1
        key = (capacity, self.scheduler.per_row_sampling)  # the two scoring paths are two programs
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if self.ahead:
            self.ahead = False
            compile_ahead(lambda: self.decode_step(capacity, self.logit_capacity), self.scheduler.chunk_total.device,
                          self.decode_step.executor.cache, self.fusion)
        for _ in range(steps):  # real steps, which also warm this shape up
            self.decode_step(capacity, self.logit_capacity)
        if self.capture:
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, pool=self.pool):
                for _ in range(steps):
                    self.decode_step(capacity, self.logit_capacity)
            self.graphs[key] = graph
