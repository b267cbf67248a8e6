"""Compiling a program's Triton kernels in parallel before it first runs.

A process's first decode step meets each of its kernels for the first time, and Triton compiles them one after the
other as they launch: about 0.3–0.9 s each (frontend, LLVM, ptxas, then a C launcher built with the system
compiler at first launch), eight in an SDAR step. Every kernel of this package launches through
`launch(kernel, grid, *args, **kwargs)`. Inside `compiling_ahead(device)` a launch enqueues nothing: it hands its
compile to a pool of threads through Triton's asynchronous compile mode (ptxas and the launcher build are
subprocesses; a thread pool compiled 13 kernels in 1.4 s instead of 4.6 on a 16-core H200 host), and on leaving,
every kernel compiled is loaded onto `device` and has its launcher built, in parallel as well. The caller runs the
program once that way where running it changes nothing (`generation.graphs` captures the step into a graph it
throws away); the real run then finds every kernel ready. A launch whose arguments specialize differently from the
one ahead compiles when it comes, as before: compiling ahead only ever saves time.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from . import TRITON_AVAILABLE

WORKERS = 8

COMPILES_AHEAD = False  # Triton's asynchronous compile mode (Triton >= 3.4)
if TRITON_AVAILABLE:
    try:
        from triton import AsyncCompileMode
        from triton.runtime._async_compile import FutureKernel, active_mode  # active_mode: the mode in force

        COMPILES_AHEAD = True
    except ImportError:
        pass

_AHEAD: ContextVar[list | None] = ContextVar("hf_blockdiff_compiling_ahead", default=None)


def launch(kernel, grid, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)`; inside `compiling_ahead`, its compile instead (nothing is launched)."""
    compiled = _AHEAD.get()
    if compiled is None:
        kernel[grid](*args, **kwargs)
    else:
        compiled.append(kernel.warmup(*args, grid=grid, **kwargs))


def can_compile_ahead(device: torch.device) -> bool:
    """Whether `compiling_ahead` works here: CUDA, Triton with asynchronous compiles, none already under way."""
    return device.type == "cuda" and COMPILES_AHEAD and active_mode.get() is None


@contextmanager
def compiling_ahead(device: torch.device):
    """Launches inside compile in parallel instead of running; on exit every kernel is compiled and loaded."""
    if not can_compile_ahead(device):
        raise RuntimeError("compiling_ahead needs a CUDA device and Triton >= 3.4, outside another asynchronous "
                           "compile; check can_compile_ahead(device) first")
    compiled: list = []
    with ThreadPoolExecutor(WORKERS, thread_name_prefix="hf_blockdiff_compile") as pool:
        with AsyncCompileMode(pool):
            token = _AHEAD.set(compiled)
            try:
                yield
            finally:
                _AHEAD.reset(token)
        unique = {id(kernel): kernel for kernel in compiled if kernel is not None}  # a kernel launched twice
        list(pool.map(lambda kernel: _load(kernel, device), unique.values()))


def _load(kernel, device: torch.device) -> None:
    """Load a compiled kernel onto `device` and build its launcher (what Triton does at a kernel's first launch;
    `_init_handles` is idempotent, and the thread has no current device until told)."""
    if isinstance(kernel, FutureKernel):  # what warmup returns for a kernel it compiled
        kernel = kernel.result()
    with torch.cuda.device(device):
        kernel._init_handles()
