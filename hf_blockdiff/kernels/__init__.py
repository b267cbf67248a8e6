"""Compute kernels. Each Triton kernel has a plain-torch reference beside it; nothing here imports the rest of
hf_blockdiff. Triton is optional: every module imports without it, and the torch references work without it."""

import os

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (read when its kernels are defined)

try:
    import triton  # noqa: F401

    TRITON_AVAILABLE = True
except ImportError:
    TRITON_AVAILABLE = False


def require_triton(what: str) -> None:
    if not TRITON_AVAILABLE:
        raise RuntimeError(f"{what} needs Triton; install it with `pip install triton` or use the torch reference")


def runs_triton(tensor) -> bool:
    """Whether the fused Triton kernels take `tensor` (CUDA, Triton installed); else their torch references do."""
    return tensor.is_cuda and TRITON_AVAILABLE
