"""How torch.compile traces hf_blockdiff's compiled code (the decoder layers, their regions, the step's bookkeeping),
and the files its artifacts are kept in: named by a digest of what they are valid for (the environment among it),
written whole, bounded in number (`integrations/compile_cache.py`, `fusion/ahead_of_time.py`)."""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers


@contextmanager
def compile_settings(job: str | None = None):
    """How torch.compile traces our compiled code, the decoder layers and the step's bookkeeping:
    - every size its own symbol (no duck sizing): slots equal to the heads by chance would tie them, and a call of
      another batch would recompile;
    - with `job` (`profile_job`; a job id the user set wins), dynamo keeps its profile of the dimensions that turned
      dynamic in inductor's cache directory (and in `hf-blockdiff warmup`'s artifacts), so a later process compiles
      the layers with the token dimension dynamic at once, instead of static at the prefill and again at the first
      step (docs/benchmarks.md, "Eval loops")."""
    with torch.fx.experimental._config.patch(use_duck_shape=False), \
            torch.compiler.config.patch(job_id=torch.compiler.config.job_id or job):
        yield


def environment() -> dict:
    """What compiled artifacts are valid for: torch, triton, transformers (whose layers' code they inline) and the
    GPU (or the CPU)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
            "device": device}


def digest(value) -> str:
    """A short stable digest of a JSON-able value (the names of compiled artifacts' files)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_whole(path: Path, data: bytes) -> None:
    """Write `data` to a file of this process beside `path`, then rename it into place: a reader, or another process
    writing the same artifact (torchrun ranks), never sees part of a file."""
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def keep_newest(directory: Path, count: int, pattern: str = "*.bin") -> None:
    """Remove all but the `count` most recently written files matching `pattern` (artifacts, `*.bin`, and a `.json`
    beside one) of `directory`: the bound of a compile cache's directories."""
    files = sorted(directory.glob(pattern), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in files[count:]:
        old.unlink(missing_ok=True)
        old.with_suffix(".json").unlink(missing_ok=True)
