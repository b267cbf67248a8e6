"""Functions compiled ahead of time into a named compile cache (`compile_cache.load`, `hf-blockdiff warmup`,
`bench --compile-cache`, the eval callback's `compile_cache`): the step's bookkeeping (`generation/precompiled.py`)
and the compiled layers' two regions (`fusion/regions.py`). Each is traced whole by torch's `aot_compile`, sizes as
symbols, saved in a folder of the cache, and loaded by a later process in milliseconds, where torch.compile traces
it again in every process (docs/benchmarks.md, "Eval loops").

An artifact keeps the guards torch can serialize (tensors' dtypes, devices, ranks and size relations, plain values)
and drops the others (object identities: a strategy's function, a module's class or an installed forward). The
caller's key, in the file name, carries what those would have checked, and this module adds the library's source and
the environment (torch, triton, GPU), so another key's code never runs. A call whose inputs fail every variant's
guards compiles one more. Anything failing here (a trace torch cannot capture whole or serialize) warns once and the
caller goes back to torch.compile, as it always does on a torch without `aot_compile` (before 2.11); an unreadable or
damaged file is skipped with a warning (docs/kernels.md, "Kernels and backends")."""

from __future__ import annotations

import functools
import inspect
import threading
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path
from unittest import mock
from typing import Callable

import torch

from .compiling import compile_settings, digest, environment, keep_newest, write_whole

MAX_FILES = 64  # artifacts kept in each folder, newest first (a few hundred KB each)
# torch's aot_compile (experimental; 2.11 and later, behind `enable_aot_compile` in 2.11), checked with torch 2.11 on
# the GPU and the CPU and with 2.13 on the CPU (tests/test_precompiled_bookkeeping.py, tests/test_compiled_regions.py)
AVAILABLE = hasattr(torch._dynamo.config, "enable_aot_compile") and hasattr(torch.compiler, "load_compiled_function")
_directory: Path | None = None


def use_directory(path: str | Path | None) -> None:
    """Save and load artifacts in `path` from now on, for the whole process (None: stop)."""
    global _directory
    _directory = None if path is None else Path(path)


@functools.cache
def _source() -> str:
    """A digest of the library's Python source: another version's artifacts are traced anew."""
    root = Path(__file__).resolve().parents[1]
    return digest([path.read_text() for path in sorted(root.rglob("*.py"))])


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
    the instance by name, is saved as the function and the module; a closure (a layer's regions, over a lock), which
    no guard reads, as a placeholder. For the duration of a trace."""
    pickler = torch._dynamo.guards.GuardsStatePickler
    reduce = pickler.reducer_override

    def reducer_override(self, obj):
        if inspect.ismethod(obj) and isinstance(obj.__self__, torch.nn.Module) \
                and vars(obj.__self__).get("forward") is obj:
            return pickler._unpickle_bound_method, (obj.__func__, obj.__self__)
        forward = vars(obj).get("forward") if isinstance(obj, torch.nn.Module) else None
        if forward is not None and not inspect.ismethod(forward):
            self.missing_values[id(forward)] = forward
        return reduce(self, obj)

    with mock.patch.object(pickler, "reducer_override", reducer_override):
        yield


class AheadOfTime:
    """`function` through `aot_compile`, its variants by key, loaded from or saved to the directory's `folder`;
    `f_globals`: the globals its loaded code runs with (its module's)."""

    def __init__(self, name: str, function: Callable, folder: str, f_globals: dict):
        self.name, self.function, self.folder, self.f_globals = name, function, folder, f_globals
        self.failed: set[str] = set()  # the callers' keys that went back to torch.compile
        self.variants: dict[tuple[Path, str], list] = {}  # (folder, file key) -> variants
        self.file_keys: dict[str, str] = {}  # caller's key -> file key
        self.lock = threading.Lock()

    def variant(self, key: str, args: tuple, kwargs: dict):
        """The compiled function for these inputs under the caller's `key`, or None where no directory is named or
        this path failed (the caller then runs torch.compile)."""
        if _directory is None or key in self.failed or not AVAILABLE:
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

    def _variant(self, directory: Path, key: str, args: tuple, kwargs: dict):
        known = self.variants.get((directory, key))
        if known is None:
            known = self.variants[directory, key] = self._load(directory, key)
        for compiled in known:
            if compiled.guard_check(*args, **kwargs):
                return compiled
        compiled = self._compile(args, kwargs)
        compiled.disable_guard_check()  # `_variant` checks the guards before each call, once
        known.append(compiled)
        self._save(compiled, directory / f"{self.name}-{key}-{len(known) - 1}.bin")
        return compiled

    def _compile(self, args: tuple, kwargs: dict):
        """Traced whole, sizes as symbols (floats read as constants: aot_compile does not restart a trace that would
        make them tensors)."""
        with compile_settings(), torch._dynamo.config.patch(specialize_float=True, enable_aot_compile=True), \
                _set_forwards_pickled():
            return torch.compile(self.function, dynamic=True, fullgraph=True).aot_compile((args, kwargs))

    def _load(self, directory: Path, key: str) -> list:
        loaded = []
        for path in sorted(directory.glob(f"{self.name}-{key}-*.bin")):
            try:
                with path.open("rb") as file:
                    compiled = torch.compiler.load_compiled_function(file, f_globals=self.f_globals)
                compiled.disable_guard_check()  # `_variant` checks the guards before each call, once
                loaded.append(compiled)
            except Exception as error:  # a damaged file is a compile, never a crash
                warnings.warn(f"compile cache {path}: not loadable ({type(error).__name__}: {error}); skipped.")
        return loaded

    def _save(self, compiled, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # not `save_compiled_function`, which writes in place on torch 2.11
            write_whole(path, type(compiled).serialize(compiled).serialized_data)
            keep_newest(path.parent, MAX_FILES)
        except OSError as error:
            warnings.warn(f"compile cache {path.parent}: not writable ({error}); the next process traces "
                          f"{self.name} again.")
