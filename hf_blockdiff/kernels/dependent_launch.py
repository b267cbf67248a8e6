"""Programmatic dependent launch (CUDA, Hopper and later): a kernel may start while the one before it in the stream
finishes, and wait for it only where it reads what that kernel wrote.

A decode step at small batch is a chain of short kernels (a few microseconds each, tens per layer), and the gap
between one's last block and the next one's first loads is a large share of each. Kernels launched with
`launch_pdl=True` call `allow_dependents` at their start, so the next kernel's blocks are placed as soon as all of
theirs are; they read weights (which no kernel of a decode call writes) before `wait_inputs`, everything else after.
`wait_inputs` returns once the previous kernel in the stream has finished and its writes are visible; every such
kernel calls it before its first store, so each kernel also follows every earlier one. Kernels launched without the
attribute (torch's, inductor's, cuBLAS's) wait for all before them as usual, and CUDA graph capture keeps the
dependencies. Off Hopper, on CPU and under TRITON_INTERPRET both calls compile to nothing.
"""

import functools

import torch

from . import INTERPRETED, TRITON_AVAILABLE


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` launch as programmatic dependents (the kernels' `GDC` flag, `launch_options`):
    NVIDIA GPUs of compute capability ≥ 9 with Triton ≥ 3.4 (not ROCm, whose launcher has no such option)."""
    if (device.type != "cuda" or INTERPRETED or not GDC_AVAILABLE
            or torch.version.hip is not None):
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(dependent: bool) -> dict:
    """The launch keyword for a dependent launch; nothing otherwise (Triton before 3.4 knows no `launch_pdl`)."""
    return {"launch_pdl": True} if dependent else {}


GDC_AVAILABLE = False  # Triton's gdc_wait / gdc_launch_dependents (3.4 and later)
if TRITON_AVAILABLE:
    import triton
    import triton.language as tl

    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401  (Triton >= 3.4)

        GDC_AVAILABLE = True
    except ImportError:
        pass

    @triton.jit
    def allow_dependents(GDC: tl.constexpr):
        """Let the next kernel in the stream be placed once every program of this one has started."""
        if GDC:
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def wait_inputs(GDC: tl.constexpr):
        """Wait until the previous kernel in the stream has finished and its writes are visible."""
        if GDC:
            tl.extra.cuda.gdc_wait()

    @triton.jit
    def follow_previous(GDC: tl.constexpr):
        """The start of a kernel that reads nothing before the previous one has finished: both of the above."""
        allow_dependents(GDC)
        wait_inputs(GDC)
