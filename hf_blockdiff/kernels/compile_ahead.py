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

A launch may name candidate configurations (`configs`, from `device_limits.fitting`): it runs the first that loads on
the device. One that does not (Triton's `OutOfResources`: more shared memory, or more registers for its threads, than
a block may have) is passed over for the next, at launch or, ahead, at loading, and the one that loaded is remembered
for that kernel, device, candidate list and keywords, so later launches, and CUDA graph captures (which must not
compile), go straight to it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable

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
_LOADED: dict = {}  # (kernel, device, configs, keywords) -> index of the configuration that loaded

OUT_OF_RESOURCES: tuple = ()  # what a configuration too large for the device raises
if TRITON_AVAILABLE:
    from triton.runtime.errors import OutOfResources

    OUT_OF_RESOURCES = (OutOfResources,)


@dataclass
class _Ahead:
    """A launch inside `compiling_ahead`: its compile (`compiled`, of `configs[start]`) and how to compile another."""

    kernel: Any
    grid: Any
    args: tuple
    kwargs: dict
    configs: tuple
    key: tuple | None
    start: int
    compiled: Any = None

    def compile(self, config: dict):
        return self.kernel.warmup(*self.args, grid=_grid(self.grid, config), **self.kwargs, **config)


def launch(kernel, grid, *args, configs: tuple = ({},), **kwargs) -> None:
    """`kernel[grid](*args, **kwargs, **config)` with the first of `configs` (keyword sets: BLOCK_* sizes,
    num_warps, num_stages) that loads on the device; `grid` is a tuple or a function of the configuration. Inside
    `compiling_ahead`, its compile instead (nothing is launched); loading, and any step down, come on leaving."""
    key = None  # one configuration: nothing to remember
    if len(configs) > 1:
        device = next((arg.device for arg in args if isinstance(arg, torch.Tensor)), None)
        key = (kernel, device, _frozen(configs), _frozen(kwargs))
    start = _LOADED.get(key, 0)
    compiled = _AHEAD.get()
    if compiled is not None:
        ahead = _Ahead(kernel, grid, args, kwargs, configs, key, start)
        ahead.compiled = ahead.compile(configs[start])
        compiled.append(ahead)
        return
    _first_that_loads(kernel, key, configs, start,
                      lambda config: kernel[_grid(grid, config)](*args, **kwargs, **config))


def _grid(grid, config: dict) -> tuple:
    return grid(config) if callable(grid) else grid


def _frozen(value) -> tuple:
    """A hashable copy of keyword sets (a dict, or a tuple of dicts)."""
    if isinstance(value, dict):
        return tuple(value.items())
    return tuple(tuple(config.items()) for config in value)


def _first_that_loads(kernel, key: tuple | None, configs: tuple, start: int, attempt: Callable[[dict], None]) -> None:
    """`attempt` each configuration from `configs[start]` on until one raises no `OutOfResources`; remember it
    under `key` (None: a single configuration)."""
    for index in range(start, len(configs)):
        try:
            attempt(configs[index])
        except OUT_OF_RESOURCES as error:
            failure = error
            continue
        if key is not None:
            _LOADED[key] = index
        return
    raise RuntimeError(f"Triton kernel {getattr(kernel, '__name__', kernel)}: none of its {len(configs)} "
                       f"configurations fits this device ({failure}); its smallest needs more than the device "
                       "gives a block") from failure


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
        # a kernel launched twice with one specialization compiles once
        unique = {id(ahead.compiled): ahead for ahead in compiled if ahead.compiled is not None}
        list(pool.map(lambda ahead: _load(ahead, device), unique.values()))


def _load(ahead: _Ahead, device: torch.device) -> None:
    """Load a compiled kernel onto `device` and build its launcher (what Triton does at a kernel's first launch;
    `_init_handles` is idempotent, and the thread has no current device until told); where it does not fit, compile
    and load the next configuration (asynchronous compiles are over: this one compiles here)."""

    def attempt(config: dict) -> None:
        kernel = ahead.compiled if config is ahead.configs[ahead.start] else ahead.compile(config)
        if isinstance(kernel, FutureKernel):  # what warmup returns for a kernel it compiled
            kernel = kernel.result()
        kernel._init_handles()

    with torch.cuda.device(device):
        _first_that_loads(ahead.kernel, ahead.key, ahead.configs, ahead.start, attempt)
