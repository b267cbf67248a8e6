"""The test harness itself (tests/conftest.py)."""

import sys


def test_tests_run_above_a_frame_with_a_stack_of_their_own():
    """Every test runs inside a frame declaring a 1 MiB stack, so the Triton interpreter's calls stay clear of the
    frame-stack chunk edges where Python 3.11 maps and unmaps a chunk per call (docs/kernels.md, "Kernels and
    backends")."""
    frame, declared = sys._getframe(), []
    while frame is not None:
        declared.append(frame.f_code.co_stacksize)
        frame = frame.f_back
    assert max(declared) >= 1 << 17
