"""The step's bookkeeping compiled ahead of time, where the user names a compile cache (`fusion/ahead_of_time.py`):
each of the scheduler's four calls is traced once by torch's `aot_compile`, saved in the cache's `bookkeeping/`, and
loaded by a later process in milliseconds, where torch.compile traces it again in every process (5.4 s of SDAR-4B's
first call at batch 32 with warm caches; docs/benchmarks.md, "Eval loops").

The guards an artifact drops (object identities, e.g. the strategy's function) are in its key: the decode config,
whether rows sample by their own settings and the window policy, so one config's bookkeeping never runs another's.
Sizes are symbols, as with torch.compile, so engines of other shapes reuse it. Its compiled code decides bit for bit
what its eager code decides (tests/test_compiled_bookkeeping.py, and tests/test_gpu.py on CUDA), so with the compile
worker on (`compile_cache.load`) a cold process runs it eager until the worker's artifact lands
(`fusion/compile_worker.py`)."""

from __future__ import annotations

import sys
import weakref

from ..fusion.ahead_of_time import AheadOfTime
from ..fusion.compiling import digest
from ..scheduler import Scheduler


class PrecompiledPhase:
    """One scheduler call (`Scheduler.<name>`) through `aot_compile`, keyed by what its scheduler's config gives."""

    def __init__(self, name: str):
        self.compiled = AheadOfTime(name, getattr(Scheduler, name), "bookkeeping",
                                    vars(sys.modules[Scheduler.__module__]), in_worker=True)
        self.keys: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # scheduler -> its config's digest

    def variant(self, scheduler: Scheduler, *args, **kwargs):
        """The compiled function for this call's inputs, EAGER while the compile worker compiles it, or None (the
        caller then runs torch.compile)."""
        return self.compiled.variant(self._key(scheduler), (scheduler, *args), kwargs)

    def _key(self, scheduler: Scheduler) -> str:
        static = self.keys.get(scheduler)
        if static is None:
            static = self.keys[scheduler] = digest([repr(scheduler.cfg), type(scheduler.policy).__name__])
        return f"{static}-{int(scheduler.per_row_sampling)}"
