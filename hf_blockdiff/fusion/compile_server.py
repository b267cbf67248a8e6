"""The compile worker's own loop (fusion/compile_worker.py): it reads a job, sets the decoding process's global
state and compile configs, rebuilds the job's inputs as tensors of their shapes, traces the function ahead of time
(`fusion/ahead_of_time.py`), saves the artifact into the compile cache and replies with why it saved nothing, or
None."""

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
        if storage is None:
            data = (torch.frombuffer(bytearray(values), dtype=torch.uint8) if values else
                    torch.empty(nbytes, dtype=torch.uint8, device=device))
            storage = self.storages[index] = data.untyped_storage()
        tensor = torch.empty(0, dtype=dtype, device=device).set_(storage, offset, size, stride)
        return torch.nn.Parameter(tensor, requires_grad) if parameter else tensor.requires_grad_(requires_grad)


def unpickle_inputs(data: bytes) -> tuple[tuple, dict]:
    return _Unshapes(io.BytesIO(data)).load()


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


def _run(job: Job) -> str | None:
    """Trace and save one job; why no artifact was saved, or None."""
    function = pkgutil.resolve_name(job.function)
    changes = {}
    for name, values in job.configs.items():
        config = importlib.import_module(name)
        mine = config.save_config_portable()
        changes[name] = {key: value for key, value in values.items() if key in mine and mine[key] != value}
    args, kwargs = unpickle_inputs(job.inputs)
    ahead = AheadOfTime(job.name, function, Path(job.directory).name, vars(sys.modules[function.__module__]))
    with warnings.catch_warnings(record=True) as caught, ExitStack() as patches:
        warnings.simplefilter("always")
        if job.state["inference"]:  # not `inference_mode(False)`, which turns grad mode on
            patches.enter_context(torch.inference_mode())
        _set_global_state(job.state)
        for name, values in changes.items():
            patches.enter_context(importlib.import_module(name).patch(values))
        saved = ahead._save(ahead._compile(args, kwargs), Path(job.directory), job.key)
    return None if saved else "; ".join(str(w.message) for w in caught) or "not saved"


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
            error = _run(job)
        except Exception as exception:  # the caller compiles in its own process and says why
            error = f"{type(exception).__name__}: {exception}"
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # the job's inputs (a layer's weights) go back to the device
        try:
            send(replies, (ticket_id, error))
        except OSError:  # the decoding process is gone: the artifact is saved for the next one
            pass
