"""The compile worker's own loop (fusion/compile_worker.py): it reads a job, sets the decoding process's global
state and compile configs, rebuilds the job's inputs as tensors of their shapes, traces the function ahead of time
(`fusion/ahead_of_time.py`), saves the artifact into the compile cache, runs it once on a GPU (`_first_run`) and
replies with why it saved nothing, or None."""

from __future__ import annotations

import importlib
import io
import os
import pickle
import pkgutil
import select
import sys
import warnings
from contextlib import ExitStack
from pathlib import Path

import torch

from .ahead_of_time import AheadOfTime
from .compile_worker import Job, receive, send

NICENESS = 10  # the worker's, above the decoding process's (`os.nice`)
IDLE_S = 60.0  # a worker without a job for this long exits, its CUDA context with it; the next job starts another


class _Unshapes(pickle.Unpickler):
    """Tensors as `compile_worker.pickle_inputs` pickled them: one storage per storage sent, so views alias as they
    did."""

    def __init__(self, file):
        super().__init__(file)
        self.storages: dict[int, torch.UntypedStorage] = {}

    def persistent_load(self, pid):
        index, device, nbytes, values, dtype, size, stride, offset, parameter, requires_grad = pid
        storage = self.storages.get(index)
        if storage is None:  # zeros where no values came: a first run reads them (`_first_run`)
            data = (torch.frombuffer(bytearray(values), dtype=torch.uint8) if values else
                    torch.zeros(nbytes, dtype=torch.uint8, device=device))
            storage = self.storages[index] = data.untyped_storage()
        tensor = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)
        return torch.nn.Parameter(tensor, requires_grad) if parameter else tensor.requires_grad_(requires_grad)


def unpickle_inputs(data: bytes) -> tuple[tuple, dict, bool]:
    """The job's args and kwargs, and whether any of them is on a GPU."""
    unshapes = _Unshapes(io.BytesIO(data))
    args, kwargs = unshapes.load()
    return args, kwargs, any(storage.device.type == "cuda" for storage in unshapes.storages.values())


def _first_run(compiled, args: tuple, kwargs: dict) -> bool:
    """Run a saved artifact once, on its inputs (zeros where the decoding process sent no values). On a GPU inductor
    autotunes a kernel at its first run and keeps the choice in its cache directory, which the decoding process
    shares, so its own first run there (the call in which the jobs land) loads the choice instead of timing each
    configuration (docs/benchmarks.md, "Eval loops"). Whether the CUDA context is still usable: a run that
    fails, as a device-side assert on values no decoding gives would, costs only that, and ends the worker after its
    reply (the next job starts another)."""
    try:
        compiled(*args, **kwargs)
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # where a device-side assert surfaces
        return True
    except Exception:  # the artifact is saved and sound; the decoding process autotunes at its first run instead
        return False


def _set_global_state(state: dict) -> None:
    """The decoding process's global state (`compile_worker.global_state`), for the worker's traces: an artifact
    traced in another one would fail its guards there. A state it cannot set (autocast) fails the job."""
    torch.set_grad_enabled(state["grad"])
    torch.set_default_dtype(state["dtype"])
    torch.use_deterministic_algorithms(state["deterministic"], warn_only=state["warn_only"])
    torch.set_num_threads(state["threads"])
    for name, value in state["matmul"].items():
        setattr(torch.backends.cuda.matmul, name, value)
    mine = torch._C._dynamo.guards.GlobalStateGuard().__getstate__()
    if mine != state["guard"]:
        raise RuntimeError(f"its global state cannot be set in the worker ({state['guard']} there, {mine} here)")


def _run(job: Job) -> tuple[str | None, bool]:
    """Trace, save and, on a GPU, first run one job: why no artifact was saved (or None), and whether the worker's
    CUDA context is still usable (`_first_run`)."""
    function = pkgutil.resolve_name(job.function)
    changes = {}
    for name, values in job.configs.items():
        config = importlib.import_module(name)
        mine = config.save_config_portable()
        changes[name] = {key: value for key, value in values.items() if key in mine and mine[key] != value}
    args, kwargs, on_gpu = unpickle_inputs(job.inputs)
    ahead = AheadOfTime(job.name, function, Path(job.directory).name, vars(sys.modules[function.__module__]))
    with warnings.catch_warnings(record=True) as caught, ExitStack() as patches:
        warnings.simplefilter("always")
        if job.state["inference"]:  # not `inference_mode(False)`, which turns grad mode on
            patches.enter_context(torch.inference_mode())
        _set_global_state(job.state)
        for name, values in changes.items():
            patches.enter_context(importlib.import_module(name).patch(values))
        compiled = ahead._compile(args, kwargs)
        saved = ahead._save(compiled, Path(job.directory), job.key)
        usable = not (saved and on_gpu) or _first_run(compiled, args, kwargs)
    return (None if saved else "; ".join(str(w.message) for w in caught) or "not saved"), usable


def serve() -> None:
    """The worker's loop: a job a message on stdin, its outcome on stdout, until stdin closes or no job came for
    IDLE_S. Stray prints go to stderr, off the replies' stream. It runs at a lower priority than the decoding
    process, whose calls it must not slow down where the host's cores are all busy."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    os.nice(NICENESS)  # its compile processes inherit it
    requests = os.fdopen(os.dup(0), "rb", buffering=0)  # unbuffered: `select` sees every byte not yet read
    while select.select([requests], [], [], IDLE_S)[0]:
        try:
            ticket_id, job = receive(requests)
        except EOFError:
            return
        try:
            error, usable = _run(job)
        except Exception as exception:  # the caller compiles in its own process and says why
            error, usable = f"{type(exception).__name__}: {exception}", True
        if usable and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # the job's inputs (a layer's weights) go back to the device
        try:
            send(replies, (ticket_id, error))
        except OSError:  # the decoding process is gone: the artifact is saved for the next one
            pass
        if not usable:  # exits as when idle: the decoding process sends what is pending to another worker
            return
