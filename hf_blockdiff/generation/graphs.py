"""CUDA graphs of the decode step: one graph per chunk-capacity bucket, captured lazily, replayed while the engine
lives on the model (reused across calls, dropped by `free_cache`).

A step (`DecodeStep` with fixed capacities) has static shapes and no host sync, and it prepares its successor
into fixed buffers, so one replay runs forward, scoring, strategy, canvas and state updates as one GPU program. The
host reads back the next step's chunk count (with the done flags) to pick the bucket. Where a mode bounds every
window (single-block block-causal decoding) and the bound is a small forward, whose cost hardly depends on its token
count, one graph chains `CHAIN_STEPS` steps at the bound with no host round trip between them. Off CUDA the same
fixed-shape steps run eagerly, which is how the CPU tests check them against the exactly-sized step.

Before the first step whose forward is the first of its size class in the process (`size_class`), `compile_ahead`
compiles the step's Triton kernels in parallel: a cold process's first call (docs/benchmarks.md, "Cold start"), and
a later call whose forwards fit the skinny GEMMs' tiles for the first time ("Eval loops").

Every capture runs with Python's cyclic garbage collector paused (`capturing`): torch no longer collects before a
capture (`torch.compiler.config.force_cudagraph_gc` is off by default), so a collection that happens to start inside
one can free an earlier engine's graphs, and their reset (freeing graph memory) is an operation a capture forbids:
the capture fails with "operation failed due to a previous error during capture".
"""

from __future__ import annotations

import gc
import math
import os
import threading
import warnings
import weakref
from contextlib import contextmanager
from typing import Callable

import torch

from ..cache import PagedBlockCache
from ..fusion.ahead_of_time import running_as_written
from ..fusion.compile_worker import WORKER
from ..kernels.compile_ahead import can_compile_ahead, compiling_ahead
from ..kernels.skinny_gemm import MAX_ROWS
from .step import DecodeStep

CHAIN_STEPS = 8
SMALL_FORWARD_TOKENS = 64  # up to here a forward reads the weights once however many tokens it holds


# model -> the size classes whose step compiled ahead on it, for as long as the model lives (an id could be reused)
_COMPILED_AHEAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def size_class(tokens: int) -> tuple[int, int]:
    """What our Triton kernels specialize on of a forward's size: the skinny GEMMs' tile height (16, 32 or 64 rows:
    kernels/skinny_gemm.py; one class above them), and its largest power-of-two divisor up to 16 (0 for one token),
    which decides whether a row count derived from it (times heads, say) is a multiple of 16 or 1, the integers
    Triton specializes on. A step of a class met before in the process finds its kernels compiled, so only a new
    class compiles ahead: a thrown-away capture of every new bucket, compiled code running as written, took 0.3-0.5 s
    of each call (docs/benchmarks.md, "Eval loops")."""
    return min(1 << max(4, (tokens - 1).bit_length()), 2 * MAX_ROWS), math.gcd(tokens, 16) if tokens > 1 else 0


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


def compile_ahead(program: Callable[[], None], device: torch.device, cache: PagedBlockCache) -> bool:
    """Compile the Triton kernels `program` launches, in parallel, without running it: inside
    `kernels.compile_ahead.compiling_ahead` it is captured into a graph that is thrown away, so nothing it enqueues
    runs (its writes included). Only for programs a graph may capture. What is compiled runs as written there
    (`running_as_written`: compiled layers and bookkeeping would compile, or autotune, inside the capture); our
    kernels are launched with the arguments they get inside compiled code. Skipped unless every layer of `cache` has
    its pools (one allocated inside the thrown-away graph would keep its zeros unwritten). Whether it ran. It only
    ever saves time: a program that fails there is said once, and its kernels compile as they come."""
    if not (cache.fully_allocated and can_compile_ahead(device)):
        return False
    try:
        with compiling_ahead(device), running_as_written():
            graph = torch.cuda.CUDAGraph()
            # relaxed: the program may meet an op for the first time here (the real capture comes after eager
            # steps), whose lazy set-up (cuBLAS's, ...) makes calls a stricter capture refuses; never replayed
            with capturing(graph, capture_error_mode="relaxed"):
                program()
    except Exception as error:  # nothing ran: the real steps compile what they launch
        warnings.warn(f"compiling a step's Triton kernels ahead failed ({type(error).__name__}: {error}); they "
                      "compile one by one as the step first launches them.", stacklevel=2)
    return True


def compile_ahead_once(program: Callable[[], None], device: torch.device, cache: PagedBlockCache, model,
                       tokens: int) -> None:
    """`compile_ahead` for a step of `tokens` a forward, unless one of its size class (`size_class`) compiled ahead
    on `model` before in this process."""
    done, size = _COMPILED_AHEAD.setdefault(model, set()), size_class(tokens)
    if size not in done and compile_ahead(program, device, cache):
        done.add(size)


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
        if self.capture:
            executor = self.decode_step.executor
            compile_ahead_once(lambda: self.decode_step(capacity, self.logit_capacity),
                               self.scheduler.chunk_total.device, executor.cache, executor.model,
                               capacity * self.scheduler.chunk)
        for _ in range(steps):  # real steps, which also warm this shape up
            self.decode_step(capacity, self.logit_capacity)
        if self.capture:
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, pool=self.pool):
                for _ in range(steps):
                    self.decode_step(capacity, self.logit_capacity)
            self.graphs[key] = graph
