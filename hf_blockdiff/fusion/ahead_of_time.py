"""Functions compiled ahead of time into a named compile cache (`compile_cache.load`, `hf-blockdiff warmup`,
`bench --compile-cache`, the eval callback's `compile_cache`): the step's bookkeeping (`generation/precompiled.py`)
and the compiled layers' two regions (`fusion/regions.py`). Each is traced whole by torch's `aot_compile`, sizes as
symbols, saved in a folder of the cache, and loaded by a later process in milliseconds, where torch.compile traces
it again in every process (docs/benchmarks.md, "Eval loops").

An artifact keeps the guards torch can serialize (tensors' dtypes, devices, ranks and size relations, plain values,
classes) and drops the others: object identities (a strategy's function, the forward installed on a module) and every
guard on a global. The caller's key, in the file name, carries what the dropped identities would have checked; this
module adds the library's source and the environment (torch, triton, transformers, GPU), and a loaded artifact runs only
while every module whose code it inlined reads as it did when traced (an edited install). A call whose inputs fail every
variant's guards compiles one more. With the compile worker on (`use_directory(..., in_worker=True)`,
`compile_cache.load`'s default), the first variant of a function that allows it is compiled there, and the caller runs
the function eager until it lands (`EAGER`; fusion/compile_worker.py). `compile_cache.save` lists the keys a process
looked up (`save_used`), and `compile_cache.load` loads their artifacts before the next process's first call
(`preload`). Anything failing here (a trace torch cannot capture whole or serialize) warns once and the caller goes back
to torch.compile, as it always does on a torch without `aot_compile` (before 2.11) and inside a trace of its own; an
unreadable or damaged file is removed with a warning (docs/kernels.md, "Kernels and backends")."""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import io
import json
import re
import threading
import traceback
import warnings
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Callable
from unittest import mock

import torch

from .compile_worker import WORKER, Job, config_values, global_state, pickle_inputs
from .compiling import compile_settings, digest, environment, keep_newest, write_whole

MAX_FILES = 64  # artifacts kept in each folder, newest first (a few hundred KB each)
# torch's aot_compile (experimental; 2.11 and later, behind `enable_aot_compile` in 2.11), checked with torch 2.11 on
# the GPU and the CPU and with 2.13 on the CPU (tests/test_precompiled_bookkeeping.py, tests/test_compiled_regions.py)
AVAILABLE = hasattr(torch._dynamo.config, "enable_aot_compile") and hasattr(torch.compiler, "load_compiled_function")
EAGER = "eager"  # `variant`'s answer while the compile worker compiles it: run the function as it is
_directory: Path | None = None
_in_worker = False  # whether functions that allow it compile in the compile worker (`use_directory`)
_TRACING = threading.Lock()  # one trace at a time in the process: it patches torch's pickler (`_set_forwards_pickled`)
_AS_WRITTEN: ContextVar[bool] = ContextVar("hf_blockdiff_as_written", default=False)  # `running_as_written`
_LOCK = threading.Lock()  # `_USED` and `_PRELOADED`, between `preload`, `save_used` and the callers' lookups
_USED: dict[tuple[Path, str, str], str] = {}  # (folder's path, name, file key) -> its globals' module: `save_used`
_PRELOADED: dict[tuple[Path, str, str], tuple] = {}  # the same -> (module, variants): what `preload` loaded
# an entry of `save_used`'s list: a folder of the directory, a function, its file key (`digest`) and one of our modules
_ENTRY = {"folder": r"[a-z_]+", "name": r"[A-Za-z_]\w*", "key": r"[0-9a-f]{16}", "module": r"hf_blockdiff(\.\w+)+"}


@contextmanager
def running_as_written():
    """Every compiled function runs eager inside: torch.compile's (its `force_eager` stance) and this module's
    artifacts (`variant` answers EAGER). For a program captured into a graph that is thrown away to compile its Triton
    kernels ahead (generation/graphs.py, `compile_ahead`), where compiled code must not compile, nor run for the
    first time: inductor's kernels autotune at their first run, which a capture forbids."""
    token = _AS_WRITTEN.set(True)
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        _AS_WRITTEN.reset(token)


def use_directory(path: str | Path | None, in_worker: bool = False) -> None:
    """Save and load artifacts in `path` from now on, for the whole process (None: stop); `in_worker`: a function
    that allows it (`AheadOfTime(in_worker=True)`) runs eager while the compile worker compiles it, instead of its
    caller waiting for the compile (fusion/compile_worker.py)."""
    global _directory, _in_worker
    _directory, _in_worker = None if path is None else Path(path), in_worker and path is not None


def save_used(directory: Path, path: Path) -> None:
    """Write to `path` the artifacts this process looked up (loaded, compiled, or given to the compile worker; for
    every model it decoded) whose files are in `directory`: what the next process loads before its first call
    (`preload`)."""
    with _LOCK:
        looked_up = [(folder.name, name, key, module) for (folder, name, key), module in _USED.items()]
    entries = [dict(zip(_ENTRY, entry)) for entry in dict.fromkeys(looked_up)
               if any((directory / entry[0]).glob(f"{entry[1]}-{entry[2]}-*.bin"))]
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, json.dumps(entries).encode())
    keep_newest(path.parent, MAX_FILES, "*.json")


def preload(path: Path) -> int:
    """Load the artifacts that `path` lists (`save_used` of an earlier process) from the directory now, so that the
    first call running them finds them in memory instead of loading them (docs/benchmarks.md, "Eval loops"); how many
    variants loaded. ValueError for a file that is not such a list: an entry names a folder of the directory, a
    function, a key and one of our modules, nothing else."""
    try:
        entries = json.loads(path.read_text())
    except FileNotFoundError:
        return 0
    if not isinstance(entries, list) or not all(map(_valid, entries)):
        raise ValueError(f"{path} is not a list of artifacts")
    if _directory is None:
        return 0
    count = 0
    with _LOCK:
        for entry in entries:
            folder, name, key, module = (entry[field] for field in _ENTRY)
            known = (_directory / folder, name, key)
            if known not in _USED and known not in _PRELOADED:  # neither looked up nor loaded here yet
                variants = _load(*known, vars(importlib.import_module(module)))
                _PRELOADED[known] = (module, variants)
                count += len(variants)
    return count


def _valid(entry) -> bool:
    return isinstance(entry, dict) and entry.keys() == _ENTRY.keys() and all(
        isinstance(entry[field], str) and re.fullmatch(pattern, entry[field]) for field, pattern in _ENTRY.items())


@functools.cache
def _source() -> str:
    """A digest of the library's Python source: another version's artifacts are traced anew."""
    root = Path(__file__).resolve().parents[1]
    return digest([path.read_text() for path in sorted(root.rglob("*.py"))])


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _no_tensor_work(error: Exception) -> bool:
    """Whether aot_compile refused a call for having no graph: one with no tensor op in this mode (the bookkeeping's
    `stored` where nothing is cached, bidirectional attention), which torch.compile runs for nothing too. Torch asserts
    that its `backend_input` is set in `aot_compile_fullgraph`, with a bare `assert` in 2.11, so the failing frame
    tells, not the message (its line, where the source is at hand)."""
    failing = traceback.extract_tb(error.__traceback__)[-1:] if isinstance(error, AssertionError) else []
    return any(frame.name == "aot_compile_fullgraph" and "backend_input" in (frame.line or "backend_input")
               for frame in failing)


@contextmanager
def _set_forwards_pickled():
    """Torch saves the objects its guards read with an artifact. Forwards set on a module's instance fail its pickling
    (torch 2.11–2.13): a method bound from a function not of the class (ours while decoding), which torch looks up on
    the instance by name, is saved as the function and the module; a closure that no guard reads (a layer's regions,
    over a lock) as a placeholder. For the duration of a trace."""
    pickler = torch._dynamo.guards.GuardsStatePickler
    reduce = pickler.reducer_override

    def reducer_override(self, obj):
        if inspect.ismethod(obj) and isinstance(obj.__self__, torch.nn.Module) \
                and vars(obj.__self__).get("forward") is obj:
            return pickler._unpickle_bound_method, (obj.__func__, obj.__self__)
        forward = vars(obj).get("forward") if isinstance(obj, torch.nn.Module) else None
        if forward is not None and not inspect.ismethod(forward) and id(forward) not in self.guard_tree_values:
            self.missing_values[id(forward)] = forward
        return reduce(self, obj)

    with mock.patch.object(pickler, "reducer_override", reducer_override):
        yield


@functools.cache
def _module_source(name: str) -> str:
    return inspect.getsource(importlib.import_module(name))


def _same_sources(compiled) -> bool:
    """Whether every module whose code the artifact inlined (ours, transformers', torch's) reads as when traced."""
    return all(_module_source(source.module) == source.content for source in compiled.source_info().inlined_sources)


class AheadOfTime:
    """`function` through `aot_compile`, its variants by key, loaded from or saved to the directory's `folder`;
    `f_globals`: the globals its loaded code runs with (its module's); `in_worker`: whether callers may run it eager
    while the compile worker compiles it."""

    def __init__(self, name: str, function: Callable, folder: str, f_globals: dict, in_worker: bool = False):
        self.name, self.function, self.folder, self.f_globals = name, function, folder, f_globals
        self.in_worker = in_worker
        self.sent: dict = {}  # (folder, file key) -> the compile worker's ticket for its first variant (None: used)
        self.failed: set[str] = set()  # the callers' keys that went back to torch.compile
        self.variants: dict[tuple[Path, str], list] = {}  # (folder, file key) -> variants
        self.file_keys: dict[str, str] = {}  # caller's key -> file key
        self.lock = threading.Lock()

    def variant(self, key: str, args: tuple, kwargs: dict):
        """The compiled function for these inputs under the caller's `key`; EAGER while the compile worker compiles
        it and inside `running_as_written`; None where no directory is named or this path failed (the caller then
        runs torch.compile)."""
        if _AS_WRITTEN.get():
            return EAGER
        if _directory is None or key in self.failed or not AVAILABLE or torch.compiler.is_compiling():
            return None
        directory = _directory / self.folder
        try:
            with self.lock:
                return self._variant(directory, self._file_key(key), args, kwargs)
        except Exception as error:  # never a failed call: torch.compile runs it, as without a directory
            self.failed.add(key)
            if not _no_tensor_work(error):
                warnings.warn(f"{self.name} could not be compiled ahead of time ({type(error).__name__}: {error}); "
                              f"it compiles in each process instead.")
            return None

    def _file_key(self, key: str) -> str:
        known = self.file_keys.get(key)
        if known is None:
            known = self.file_keys[key] = digest([self.name, key, _source(), environment()])
        return known

    def _known(self, directory: Path, key: str) -> list:
        """The key's variants: as `preload` loaded them for this function's globals, else loaded from the directory
        now."""
        known = self.variants.get((directory, key))
        if known is None:
            module = self.f_globals["__name__"]
            with _LOCK:
                preloaded = _PRELOADED.pop((directory, self.name, key), (None, None))
                known = preloaded[1] if preloaded[0] == module else _load(directory, self.name, key, self.f_globals)
                _USED[directory, self.name, key] = module
            self.variants[directory, key] = known
        return known

    def _variant(self, directory: Path, key: str, args: tuple, kwargs: dict):
        known = self._known(directory, key)
        for compiled in known:
            if compiled.guard_check(*args, **kwargs):
                return compiled
        if self.in_worker and _in_worker:
            compiled = self._from_worker(directory, key, args, kwargs)
            if compiled is not None:
                return compiled
        compiled = self._compile(args, kwargs)
        compiled.disable_guard_check()  # `_variant` checks the guards before each call, once
        known.append(compiled)
        self._save(compiled, directory, key)
        return compiled

    def _from_worker(self, directory: Path, key: str, args: tuple, kwargs: dict):
        """EAGER while the compile worker compiles this key's first variant; once it is done, the variant it saved,
        or None: a job that failed (said once) or could not be sent, inputs its variant's guards refuse, a later
        variant (each compiled in this process)."""
        if (directory, key) not in self.sent:
            try:
                job = Job(f"{self.function.__module__}:{self.function.__qualname__}", self.name, str(directory), key,
                          pickle_inputs(args, kwargs), config_values(), global_state())
            except Exception as error:  # inputs the worker cannot get
                self.sent[directory, key] = None
                warnings.warn(f"{self.name}: its inputs cannot go to the compile worker ({type(error).__name__}: "
                              f"{error}); it compiles in this process.")
                return None
            self.sent[directory, key] = WORKER.submit(job)
        ticket = self.sent[directory, key]
        if ticket is None:
            return None
        if not ticket.done or _capturing():  # its kernels first run (and autotune) in a real step, never in a capture
            return EAGER
        self.sent[directory, key] = None
        if ticket.error is not None:
            warnings.warn(f"{self.name} was not compiled by the compile worker ({ticket.error}); it compiles in "
                          "this process.")
            return None
        known = self.variants[directory, key] = _load(directory, self.name, key, self.f_globals)
        return next((compiled for compiled in known if compiled.guard_check(*args, **kwargs)), None)

    def _compile(self, args: tuple, kwargs: dict):
        """Traced whole, sizes as symbols (floats read as constants: aot_compile does not restart a trace that would
        make them tensors)."""
        with _TRACING, compile_settings(), \
                torch._dynamo.config.patch(specialize_float=True, enable_aot_compile=True), _set_forwards_pickled():
            return torch.compile(self.function, dynamic=True, fullgraph=True).aot_compile((args, kwargs))

    def _save(self, compiled, directory: Path, key: str) -> bool:
        """Saved under a digest of its bytes, once they load back (a later process would fail on them otherwise);
        whether it was."""
        try:
            data = type(compiled).serialize(compiled).serialized_data  # not `save_compiled_function`: in place on 2.11
            if _loaded(data, self.f_globals) is None:
                raise RuntimeError("its inlined sources changed while it was traced")
            directory.mkdir(parents=True, exist_ok=True)
            write_whole(directory / f"{self.name}-{key}-{hashlib.sha256(data).hexdigest()[:16]}.bin", data)
            keep_newest(directory, MAX_FILES)
            return True
        except OSError as error:
            warnings.warn(f"compile cache {directory}: not writable ({error}); the next process traces "
                          f"{self.name} again.")
        except Exception as error:  # the variant still runs in this process
            warnings.warn(f"{self.name} compiled ahead of time does not load back ({type(error).__name__}: "
                          f"{error}); not saved, the next process traces it again.")
        return False


def _loaded(data: bytes, f_globals: dict):
    """The artifact's function, running with `f_globals`, or None where code it inlined has changed since."""
    compiled = torch.compiler.load_compiled_function(io.BytesIO(data), f_globals=f_globals)
    compiled.disable_guard_check()  # `_variant` checks the guards before each call, once
    return compiled if _same_sources(compiled) else None


def _load(directory: Path, name: str, key: str, f_globals: dict) -> list:
    """The variants saved under `name` and `key` in `directory`; a damaged file, or one whose inlined code changed,
    is removed."""
    loaded = []
    for path in sorted(directory.glob(f"{name}-{key}-*.bin")):
        try:
            compiled = _loaded(path.read_bytes(), f_globals)
        except Exception as error:  # a damaged file is a compile, never a crash
            warnings.warn(f"compile cache {path}: not loadable ({type(error).__name__}: {error}); removed.")
            compiled = None
        if compiled is None:
            path.unlink(missing_ok=True)
        else:
            loaded.append(compiled)
    return loaded
