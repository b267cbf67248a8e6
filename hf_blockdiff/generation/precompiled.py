"""The step's bookkeeping compiled ahead of time, where the user names a compile cache (`compile_cache.load`,
`hf-blockdiff warmup`, `bench --compile-cache`, the eval callback's `compile_cache`): each of the scheduler's four
calls is traced once by torch's `aot_compile`, saved in the cache's `bookkeeping/`, and loaded by a later process in
milliseconds, where torch.compile traces it again in every process (5.4 s of SDAR-4B's first call at batch 32 with
warm caches; docs/benchmarks.md, "Eval loops").

An artifact keeps the guards torch can serialize (tensors' dtypes, devices, ranks and size relations, plain values)
and drops the others (object identities, e.g. the strategy's function). Its file name carries what those would have
checked: the decode config, whether rows sample by their own settings, the window policy, the library's source and
the environment (torch, triton, GPU), so one config's bookkeeping never runs another's. Sizes are symbols, as with
torch.compile, so engines of other shapes reuse it; a call whose inputs fail every variant's guards compiles one
more. Anything failing here (a trace torch cannot capture whole or serialize) warns once and the call goes back to
torch.compile, as it always does on a torch without `aot_compile` (before 2.11); an unreadable or damaged file is
skipped with a warning (docs/kernels.md, "Kernels and backends": compiled bookkeeping)."""

from __future__ import annotations

import functools
import sys
import threading
import traceback
import warnings
import weakref
from pathlib import Path

import torch

from ..fusion.mode import compile_settings, digest, environment, keep_newest, write_whole
from ..scheduler import Scheduler

MAX_FILES = 64  # artifacts kept in the directory, newest first (a few hundred KB each)
# torch's aot_compile (experimental; 2.11 and later, behind `enable_aot_compile` in 2.11), checked with torch 2.11 on
# the GPU and the CPU and with 2.13 on the CPU (tests/test_precompiled_bookkeeping.py); an older torch traces the
# bookkeeping in each process as before
AVAILABLE = hasattr(torch._dynamo.config, "enable_aot_compile") and hasattr(torch.compiler, "load_compiled_function")
_directory: Path | None = None


def use_directory(path: str | Path | None) -> None:
    """Save and load the bookkeeping's artifacts in `path` from now on, for the whole process (None: stop)."""
    global _directory
    _directory = None if path is None else Path(path)


@functools.cache
def _source() -> str:
    """A digest of the library's Python source: another version's bookkeeping is traced anew."""
    root = Path(__file__).resolve().parents[1]
    return digest([path.read_text() for path in sorted(root.rglob("*.py"))])


def _no_tensor_work(error: Exception) -> bool:
    """Whether aot_compile refused a call for having no graph: one with no tensor op in this mode (`stored` where
    nothing is cached, bidirectional attention), which torch.compile runs for nothing too. Torch asserts that its
    `backend_input` is set in `aot_compile_fullgraph`, with a bare `assert` in 2.11, so the failing frame tells, not
    the message (its line, where the source is at hand)."""
    failing = traceback.extract_tb(error.__traceback__)[-1:] if isinstance(error, AssertionError) else []
    return any(frame.name == "aot_compile_fullgraph" and "backend_input" in (frame.line or "backend_input")
               for frame in failing)


class PrecompiledPhase:
    """One scheduler call (`Scheduler.<name>`) through `aot_compile`: its variants by key, loaded or compiled."""

    def __init__(self, name: str):
        self.name, self.function = name, getattr(Scheduler, name)
        self.failed = False
        self.variants: dict[str, list] = {}
        self.keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scheduler -> what its config gives
        self.lock = threading.Lock()

    def variant(self, scheduler: Scheduler, *args, **kwargs):
        """The compiled function for this call's inputs, or None where no directory is named or this path failed
        (the caller then runs torch.compile)."""
        if _directory is None or self.failed or not AVAILABLE:
            return None
        directory = _directory
        try:
            with self.lock:
                return self._variant(directory, self._key(scheduler), (scheduler, *args), kwargs)
        except Exception as error:  # never a failed call: torch.compile runs it, as without a directory
            self.failed = True
            if not _no_tensor_work(error):
                warnings.warn(f"the step's bookkeeping ({self.name}) could not be compiled ahead of time "
                              f"({type(error).__name__}: {error}); it compiles in each process instead.")
            return None

    def _key(self, scheduler: Scheduler) -> str:
        static = self.keys.get(scheduler)
        if static is None:
            static = self.keys[scheduler] = digest([self.name, repr(scheduler.cfg), type(scheduler.policy).__name__,
                                                     _source(), environment()])
        return f"{static}-{int(scheduler.per_row_sampling)}"

    def _variant(self, directory: Path, key: str, args: tuple, kwargs: dict):
        known = self.variants.get(key)
        if known is None:
            known = self.variants[key] = self._load(directory, key)
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
        with compile_settings(), torch._dynamo.config.patch(specialize_float=True, enable_aot_compile=True):
            return torch.compile(self.function, dynamic=True, fullgraph=True).aot_compile((args, kwargs))

    def _load(self, directory: Path, key: str) -> list:
        loaded = []
        for path in sorted(directory.glob(f"{self.name}-{key}-*.bin")):
            try:
                with path.open("rb") as file:
                    compiled = torch.compiler.load_compiled_function(
                        file, f_globals=vars(sys.modules[Scheduler.__module__]))
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
