"""Fitting the kernels' launch configurations to the device's shared memory (docs/kernels.md, "Kernels and backends").

A Triton kernel that asks for more shared memory than a block of the device may have fails to load
(`triton.runtime.errors.OutOfResources`). The kernels that pipeline tiles through shared memory list candidate
configurations, from the fastest measured (on an H200) to smaller ones (`shrinking`), with an estimate of each
one's shared memory: the skinny GEMMs (`skinny_gemm._shared_bytes`), the MoE experts GEMM
(`moe_experts._shared_bytes`) and paged attention (`paged_attention._shared_bytes`). Each estimate is an upper bound
of what Triton 3.9 allocates for that kernel (its pipelined tiles, compiled for sm_80, sm_86, sm_90 and sm_120).
`fitting` keeps the candidates whose estimate fits the device, and `compile_ahead.launch` runs the first of them that
loads, stepping down on `OutOfResources` (registers are known only once compiled). The other kernels keep no tiles
in shared memory, only their reductions' scratch: at most 16 KiB at their largest launches (the MoE counting sort's
scan of 4,096 pairs; sm_90 compiles), under the 48 KiB a block gets on any CUDA GPU, so they have one configuration.
"""

import functools
from contextlib import contextmanager
from typing import Callable

import torch

_ASSUMED: list[int] = []  # limits set by `assumed_shared_memory`, innermost last


def shared_memory_limit(device) -> int | None:
    """Bytes of shared memory one block may have on `device` (the opt-in limit: 232,448 on an H100 or H200), or None
    off CUDA, where Triton's interpreter has no limit; `assumed_shared_memory` overrides it."""
    if _ASSUMED:
        return _ASSUMED[-1]
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _device_limit(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _device_limit(index: int) -> int:
    properties = torch.cuda.get_device_properties(index)
    # ROCm reports no opt-in limit: a block has what it has
    return getattr(properties, "shared_memory_per_block_optin", None) or properties.shared_memory_per_block


@contextmanager
def assumed_shared_memory(limit: int):
    """Choose configurations as if every device allowed `limit` bytes of shared memory per block (tests: an A100's
    166,912, a consumer card's 101,376), the interpreter included."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int of bytes, got {type(limit).__name__}")
    if limit <= 0:
        raise ValueError(f"limit must be a positive number of bytes, got {limit}")
    _ASSUMED.append(limit)
    try:
        yield
    finally:
        _ASSUMED.pop()


def shrinking(first: dict, steps: tuple) -> list[dict]:
    """`first`, then smaller configurations: each (parameter, floor) of `steps` in turn stepped down to its floor,
    the earlier ones staying at theirs; a tile size (BLOCK_*) halves, `num_stages` loses one."""
    configs = [dict(first)]
    for name, floor in steps:
        while configs[-1][name] > floor:
            config = dict(configs[-1])
            config[name] = config[name] - 1 if name == "num_stages" else config[name] // 2
            configs.append(config)
    return configs


def fitting(configs: list[dict], shared_bytes: Callable[[dict], int], limit: int | None) -> tuple[dict, ...]:
    """The configurations whose `shared_bytes` estimate is at most `limit` (all of them when it is None), in order:
    the first is the choice, the rest what a launch steps down to. Where none fits, the last alone (its load then
    says what is missing)."""
    if limit is None:
        return tuple(configs)
    return tuple(config for config in configs if shared_bytes(config) <= limit) or (configs[-1],)
