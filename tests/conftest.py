import functools
import os
import threading
import types

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter; set before any kernel is defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import forget_compiled_regions, tiny_model  # noqa: E402


def _run_test(test, kwargs):
    return test(**kwargs)


# CPython 3.11 and 3.12 (and 3.13 and 3.14 before their backported fix, 3.14.4) free a 16 KiB chunk of the frame
# stack as soon as calls return below it (CPython issue 142183): a hot call sitting on a chunk's edge maps and unmaps
# a chunk every time. Under pytest's deep stack the Triton interpreter's per-launch calls landed there, and the
# interpreted tests took three times as long, most of it mmap/munmap system time (docs/kernels.md, "Kernels and
# backends"). A frame declaring a 1 MiB stack gets a 2 MiB chunk of its own, and the test runs in the spare MiB above
# it, far from any edge.
_run_test_with_headroom = types.FunctionType(_run_test.__code__.replace(co_stacksize=1 << 17), {})


def _patch_the_language_once_a_launch() -> None:
    """Triton's interpreter patches triton.language's builtins for a launch, and patches them again (an
    inspect.getmembers over its modules, never undone) on every call of a @triton.jit helper inside the kernel, while
    the launch's patch is in place: most of an interpreted test's time (docs/kernels.md, "Kernels and backends").
    Inside a launch, a helper's call finds the language patched and patches nothing."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if patch is None or executor is None or not hasattr(scope_type, "restore"):
        return  # another interpreter than the one this was written for: leave it as it is
    state, run = threading.local(), executor.__call__
    languages = (interpreter.tl, interpreter.tl.core)

    def patch_once(fn):
        wanted = {id(value) for value in fn.__globals__.values() if any(value is lang for lang in languages)}
        patched = getattr(state, "patched", None)
        if patched is not None and wanted <= patched:  # a helper's call inside a launch, its language patched
            return scope_type()
        scope = patch(fn)
        if getattr(state, "launching", False):  # the launch's own patch, undone when the launch ends
            restore, state.patched, state.launching = scope.restore, set(wanted), False
            scope.restore = lambda: (setattr(state, "patched", None), restore())
        elif patched is not None:  # a helper's patch of another module (triton's standard library sees tl.core)
            patched |= wanted
        return scope

    def launch(self, *args, **kwargs):
        state.launching = True
        try:
            return run(self, *args, **kwargs)
        finally:
            state.launching, state.patched = False, None

    interpreter._patch_lang, executor.__call__ = patch_once, launch


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_a_launch()


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


@pytest.fixture(autouse=True)
def _no_ahead_of_time_state_left():
    """`compile_cache.load` names a directory for the artifacts compiled ahead of time, for the whole process: not
    past the test that loaded one, nor the regions' variants and failures (module-level, shared by every model)."""
    yield
    from hf_blockdiff.fusion import ahead_of_time

    ahead_of_time.use_directory(None)
    forget_compiled_regions()


@pytest.fixture(scope="session")
def qwen3():
    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from helpers import save_checkpoint

    return save_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"))
