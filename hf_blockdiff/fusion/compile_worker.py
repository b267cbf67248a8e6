"""A process beside the decoding one that compiles ahead of time (`fusion/ahead_of_time.py`) what the decoding one
runs eager until then, so that a cold process's first call does not wait for inductor (docs/benchmarks.md, "Eval
loops"): the step's bookkeeping, whose compiled code decides bit for bit what its eager code decides, and the
compiled layers' regions, whose eager code rounds as eager torch ops do (fusion/regions.py).

A thread compiling in the decoding process does not do: a trace holds the GIL that every launch of the decode loop needs
(calls took 7–8x their time beside one). The worker is started at a job where none runs, one per process, at a lower
priority (and exits after a minute without a job), and gets each job as the function's name and its inputs pickled as
what a trace reads of a tensor (device, dtype, sizes, strides, offset, which storage, requires_grad; the values of CPU
tensors), with the compile configs and the global state that dynamo guards; it traces, and saves the artifact into the
compile cache (fusion/compile_server.py), where the decoding process loads it. On a GPU it holds a CUDA context and,
while it traces a region, storage the size of one layer's weights. Jobs are published together once none is pending
(`landed` counts them), and CUDA graphs captured before are captured again (`generation/graphs.py`); `settle` waits for
them, with a bound. A job that fails, or a worker that exits, is reported with the cause, and the caller compiles in its
own process as it would without the worker."""

from __future__ import annotations

import importlib
import inspect
import io
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass

import torch

# the configs whose values a trace reads: the decoding process's are sent with each job
CONFIGS = ("torch._dynamo.config", "torch._inductor.config", "torch._functorch.config", "torch.fx.experimental._config",
           "torch.compiler.config")


@dataclass
class Job:
    function: str  # module:qualname, the function traced
    name: str  # the artifact's name (its files' prefix)
    directory: str  # the compile cache's folder for it
    key: str  # the artifact's file key (`AheadOfTime._file_key`)
    inputs: bytes  # (args, kwargs), pickled by `_Shapes`
    configs: dict  # config module -> its values in the decoding process
    state: dict  # the decoding process's global state that dynamo guards (`global_state`)


@dataclass
class Ticket:
    job: Job | None = None  # until it is finished
    done: bool = False
    error: str | None = None  # why no artifact was saved


class _Shapes(pickle.Pickler):
    """Pickles a tensor as what a trace reads (module docstring). Never reads a GPU tensor's values: a job may be
    submitted while a CUDA graph is captured. A module keeps the forwards set on it while decoding where they are
    methods (of functions the worker imports: the fused forwards), and loses one that is a closure (a decoder
    layer's compiled forward, which the traced regions do not call)."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.storages: dict[tuple, int] = {}

    def reducer_override(self, obj):
        if inspect.ismethod(obj):
            return _bind, (obj.__func__, obj.__self__)
        forward = vars(obj).get("forward") if isinstance(obj, torch.nn.Module) else None
        if inspect.isfunction(forward) and "<locals>" in forward.__qualname__:
            reduced = list(obj.__reduce_ex__(pickle.HIGHEST_PROTOCOL))
            reduced[2] = {name: value for name, value in reduced[2].items() if name != "forward"}
            return tuple(reduced)
        return NotImplemented

    def persistent_id(self, obj):
        if not isinstance(obj, torch.Tensor):
            return None
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise TypeError(f"a {type(obj).__name__} input: only plain tensors are sent to the compile worker")
        storage = obj.untyped_storage()
        where = (str(obj.device), storage.data_ptr(), storage.nbytes()) if storage.data_ptr() else (id(storage),)
        index = self.storages.setdefault(where, len(self.storages))
        cpu = obj.device.type == "cpu"
        values = torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes() if cpu else None
        return (index, str(obj.device), storage.nbytes(), values, obj.dtype, tuple(obj.shape), obj.stride(),
                obj.storage_offset(), isinstance(obj, torch.nn.Parameter), obj.requires_grad)


def _bind(function, owner):
    return types.MethodType(function, owner)


def pickle_inputs(args: tuple, kwargs: dict) -> bytes:
    buffer = io.BytesIO()
    _Shapes(buffer).dump((args, kwargs))
    return buffer.getvalue()


def config_values() -> dict:
    return {name: importlib.import_module(name).save_config_portable() for name in CONFIGS}


_MATMUL = ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")


def global_state() -> dict:
    """What dynamo's global-state guard checks (grad mode, default dtype, deterministic algorithms, matmul precision,
    threads), as the worker sets it, the guard's own account of it, and inference mode."""
    matmul = torch.backends.cuda.matmul
    return dict(grad=torch.is_grad_enabled(), inference=torch.is_inference_mode_enabled(),
                dtype=torch.get_default_dtype(), deterministic=torch.are_deterministic_algorithms_enabled(),
                warn_only=torch.is_deterministic_algorithms_warn_only_enabled(), threads=torch.get_num_threads(),
                matmul={name: getattr(matmul, name) for name in _MATMUL},
                guard=torch._C._dynamo.guards.GlobalStateGuard().__getstate__())


def send(stream, value) -> None:
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def receive(stream):
    (size,) = struct.unpack("<Q", _read_exactly(stream, 8))
    return pickle.loads(_read_exactly(stream, size))


def _read_exactly(stream, size: int) -> bytes:
    """`size` bytes of a stream, buffered or not; EOFError where it ends first (closed, or the sender exited while
    sending)."""
    data = bytearray()
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


class Worker:
    """The decoding process's side: a worker process started at a job where none runs (it exits when idle), a thread
    sending it jobs and one reading its replies."""

    def __init__(self):
        self.process: subprocess.Popen | None = None
        self.outbox: queue.SimpleQueue | None = None  # jobs for `_write` to send
        self.tickets: dict[int, Ticket] = {}  # pending
        self.finished: list[Ticket] = []  # not yet published (`_finish`)
        self.landed = 0  # jobs finished and published, saved or failed
        self.condition = threading.Condition()

    def submit(self, job: Job) -> Ticket:
        """The job's ticket; it is sent by a thread of its own: a worker still importing reads nothing, and a pipe
        holds 64 KB (a cold process's first call waited 12 s on it)."""
        with self.condition:
            ticket = Ticket(job)
            try:
                self._start()
            except OSError as error:  # a worker that cannot start: compiled here instead
                ticket.done, ticket.error = True, f"the compile worker does not start ({error})"
                return ticket
            self.tickets[id(ticket)] = ticket
            self.outbox.put((id(ticket), job))
            return ticket

    def _start(self) -> None:
        if self.process is not None:
            return
        command = [sys.executable, "-c", "from hf_blockdiff.fusion.compile_server import serve; serve()"]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=os.environ.copy())
        self.outbox = queue.SimpleQueue()
        for target, name in ((self._write, "compile-worker-jobs"), (self._read, "compile-worker-replies")):
            threading.Thread(target=target, args=(self.process, self.outbox), daemon=True, name=name).start()

    @staticmethod
    def _write(process: subprocess.Popen, outbox: queue.SimpleQueue) -> None:
        """Send jobs until the worker exits (`_read` fails the jobs it did not finish, and ends this loop)."""
        while (job := outbox.get()) is not None:
            try:
                send(process.stdin, job)
            except (OSError, ValueError):
                return

    def _read(self, process: subprocess.Popen, outbox: queue.SimpleQueue) -> None:
        while True:
            try:
                ticket_id, error = receive(process.stdout)
            except (EOFError, OSError, pickle.UnpicklingError):
                break
            self._finish([ticket_id], error)
        outbox.put(None)
        code = process.wait()
        with self.condition:
            self.process = None if self.process is process else self.process
            orphans = list(self.tickets)
            if code == 0 and orphans:  # it left idle (compile_server.IDLE_S) as jobs came: another takes them
                self._start()
                for ticket_id in orphans:
                    self.outbox.put((ticket_id, self.tickets[ticket_id].job))
                return
        self._finish(orphans, f"the compile worker exited (code {code})")

    def _finish(self, ticket_ids: list[int], error: str | None) -> None:
        """Jobs finished (`error`: why they saved nothing). Their outcomes are published (`done`, `landed`) together,
        once no job is pending: a process whose jobs land one by one would capture its graphs again at each, a
        slower call each time."""
        with self.condition:
            for ticket_id in ticket_ids:
                ticket = self.tickets.pop(ticket_id, None)
                if ticket is not None:
                    ticket.job, ticket.error = None, error
                    self.finished.append(ticket)
            if not self.tickets:
                for ticket in self.finished:
                    ticket.done = True
                self.landed += len(self.finished)
                self.finished.clear()
            self.condition.notify_all()

    def settle(self, timeout: float) -> bool:
        """Wait until no job is pending, at most `timeout` seconds; whether none is."""
        deadline = time.monotonic() + timeout
        with self.condition:
            while self.tickets and self.condition.wait(max(0.0, deadline - time.monotonic())):
                pass
            return not self.tickets


WORKER = Worker()
