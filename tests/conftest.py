import functools
import os
import types

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter; set before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import tiny_model  # noqa: E402


def _run_test(test, kwargs):
    return test(**kwargs)


# CPython 3.11 and 3.12 (and 3.13 and 3.14 before their backported fix, 3.14.4) free a 16 KiB chunk of the frame
# stack as soon as calls return below it (CPython issue 142183): a hot call sitting on a chunk's edge maps and unmaps
# a chunk every time. Under pytest's deep stack the Triton interpreter's per-launch calls landed there, and the
# interpreted tests took three times as long, most of it mmap/munmap system time (docs/kernels.md, "Kernels and
# backends"). A frame declaring a 1 MiB stack gets a 2 MiB chunk of its own, and the test runs in the spare MiB above
# it, far from any edge.
_run_test_with_headroom = types.FunctionType(_run_test.__code__.replace(co_stacksize=1 << 17), {})


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """pytest's own call of the test, through `_run_test_with_headroom` (while it runs, `request.function` is the
    wrapper, named and marked as the test)."""
    test = pyfuncitem.obj
    pyfuncitem.obj = functools.wraps(test)(lambda **kwargs: _run_test_with_headroom(test, kwargs))
    try:
        return (yield)
    finally:
        pyfuncitem.obj = test


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` run on the device machine (`pytest -m gpu`); CI deselects them with -m "not gpu"."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run `python -m pytest -m gpu tests` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen3():
    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from helpers import save_checkpoint

    return save_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"))
