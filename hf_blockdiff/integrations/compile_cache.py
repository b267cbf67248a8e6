"""Portable compile caches: the artifacts torch.compile made while a model decoded, saved to a directory the user
names and loaded by a fresh process before its first call, so that call reads what an earlier process compiled
instead of compiling it (docs/architecture.md, "Around the loop"). `warmup` fills the directory, e.g. in an image
build or before training starts (`hf-blockdiff warmup`).

Our own Triton kernels are compiled by Triton, not torch.compile: `load` points Triton's cache (`TRITON_CACHE_DIR`, for
the whole process) into the directory's `triton/` unless the variable is set, so their binaries travel too (Triton keys
them by source, version and GPU), and the step's bookkeeping and the compiled layers' regions are compiled ahead of time
into its `bookkeeping/` and `regions/` (fusion/ahead_of_time.py), which a later process loads instead of tracing; `save`
lists in `used/` those its process looked up, and `load` reads them, so that the next process's first call does not. A
file holds one model's artifacts (its config, dtype and tensor-parallel size) for one environment (torch, triton, GPU);
the directory keeps the newest `MAX_FILES`, and its `triton/` the most recently written kernels within
`MAX_TRITON_BYTES`. Several processes may save at once (torchrun ranks): each writes a file of its own and renames it
into place, so a reader sees a whole file. A directory that cannot be read or written, or holds only other environments'
artifacts, gives a warning naming the cause and a cold start."""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from ..config import BlockDiffusionConfig
from ..fusion import ahead_of_time
from ..fusion.compile_worker import WORKER
from ..fusion.compiling import digest, environment, keep_newest, write_whole
from ..patching import free_cache
from ..weights.tensor_parallel import tensor_parallel_size

MAX_FILES = 16
MAX_TRITON_BYTES = 2 * 1024**3  # Triton's cache in the directory (a kernel a folder, 10-500 KB each)


def model_key(model) -> str:
    """The model's shapes (its config but names and versions), dtype and tensor-parallel size."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    return digest([config, str(next(model.parameters()).dtype), tensor_parallel_size(model)])


def cache_file(model, directory: str | os.PathLike) -> Path:
    return Path(directory) / f"{model_key(model)}-{digest(environment())}.bin"


def used_file(model, directory: str | os.PathLike) -> Path:
    """Where `save` lists the artifacts compiled ahead of time that its process looked up (`ahead_of_time.save_used`),
    for `load` to read."""
    return Path(directory) / "used" / cache_file(model, directory).with_suffix(".json").name


def load(model, directory: str | os.PathLike, background: bool = True) -> bool:
    """Load the artifacts saved for this model and environment into torch's caches, and the artifacts compiled ahead
    of time that the last process saving for it looked up (`used_file`) into memory, so the first call does not;
    point Triton's cache and later artifacts compiled ahead of time into the directory. False (with a warning where
    the directory says why) when there are none. `background`: the step's bookkeeping and the layers' regions, where
    the directory lacks them, run eager while a process beside this one compiles them into the directory
    (`fusion/compile_worker.py`; `settle` waits for it), instead of the first call waiting for the compile
    (docs/benchmarks.md, "Eval loops")."""
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(directory).resolve() / "triton"))
    _ptxas_of_inductors_workers()
    ahead_of_time.use_directory(directory, in_worker=background)
    torch_artifacts = _load_torch_artifacts(model, directory)
    return _preload(model, directory) > 0 or torch_artifacts


def _preload(model, directory: str | os.PathLike) -> int:
    """The variants loaded ahead of the first call; a list that cannot be read, or whose artifacts cannot, warns, and
    they load at the first call that runs them."""
    try:
        return ahead_of_time.preload(used_file(model, directory))
    except Exception as error:  # never a failed load: the first call loads (or compiles) them
        warnings.warn(f"compile cache {directory}: its list of artifacts used cannot be read ({type(error).__name__}: "
                      f"{error}); they load at the first call.")
        return 0


def _load_torch_artifacts(model, directory: str | os.PathLike) -> bool:
    path = cache_file(model, directory)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        _warn_other_environments(model, Path(directory))
        return False
    except OSError as error:
        warnings.warn(f"compile cache {directory}: cannot read {path.name} ({error}); the first call compiles.")
        return False
    try:
        info = torch.compiler.load_cache_artifacts(data)
    except Exception as error:  # a damaged file is a cold start, never a crash
        info, data = None, f"{type(error).__name__}: {error}"
    if info is None:  # torch logs what it refused and returns None
        warnings.warn(f"compile cache {path}: not loadable{'' if isinstance(data, bytes) else f' ({data})'}; the "
                      "first call compiles.")
        return False
    return True


def settle(timeout: float = 900.0) -> bool:
    """Wait until the compile worker has compiled what `load(..., background=True)` left to it, at most `timeout`
    seconds; whether it has (the calls after it run the compiled code)."""
    return WORKER.settle(timeout)


def _ptxas_of_inductors_workers() -> None:
    """Triton keys a binary by the ptxas that assembled it. Inductor's compile workers assemble with torch's own
    (torch 2.11+cu130: CUDA 13.0's), while a kernel it compiles in the main process, as when a loaded artifact's
    kernel first runs, took Triton's bundled one (CUDA 12.8): two of the bookkeeping's kernels a warmup compiled in
    its workers missed in the next process, which compiled them again (1.0 s; docs/benchmarks.md, "Eval loops").
    The whole process takes the workers' ptxas, as they do (torch's private helper; a TRITON_PTXAS_PATH the user set
    wins, and a torch without the helper or its ptxas changes nothing)."""
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:
        return
    _set_triton_ptxas_path()


def _warn_other_environments(model, directory: Path) -> None:
    mine = environment()
    for sidecar in sorted(directory.glob(f"{model_key(model)}-*.json")):
        try:
            theirs = json.loads(sidecar.read_text())
        except (OSError, ValueError):
            continue
        differ = ", ".join(f"{name} {theirs.get(name)} there, {value} here" for name, value in mine.items()
                           if theirs.get(name) != value)
        warnings.warn(f"compile cache {directory}: its artifacts of this model are for another environment ({differ}); "
                      "the first call compiles (run the warmup in this environment to add its own).")
        return


def save(model, directory: str | os.PathLike) -> Path | None:
    """Save what this process compiled (and loaded) for this model and environment, and list the artifacts compiled
    ahead of time that it looked up (`used_file`); the file saved, or None, with a warning when the directory is not
    writable, or when torch compiled nothing."""
    artifacts = torch.compiler.save_cache_artifacts()
    path = cache_file(model, directory) if artifacts is not None and artifacts[0] else None
    try:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            for target, data in ((path, artifacts[0]), (path.with_suffix(".json"), json.dumps(environment()).encode())):
                write_whole(target, data)
            keep_newest(path.parent, MAX_FILES)
            _bound_triton(path.parent / "triton")
    except OSError as error:
        warnings.warn(f"compile cache {directory}: not writable ({error}); nothing saved, the next process compiles.")
        return None
    try:
        ahead_of_time.save_used(Path(directory), used_file(model, directory))
    except OSError as error:
        warnings.warn(f"compile cache {directory}: its list of artifacts used is not writable ({error}); the next "
                      "process loads them at its first call.")
    return path


def _bound_triton(root: Path) -> None:
    """Remove the least recently written kernel folders of Triton's cache under `root` until it holds at most
    MAX_TRITON_BYTES (a process that wanted one compiles it again)."""
    if not root.is_dir():
        return
    folders = [(folder.stat().st_mtime, sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()), folder)
               for folder in root.iterdir() if folder.is_dir()]
    total = sum(size for _, size, _ in folders)
    for _, size, folder in sorted(folders, key=lambda entry: entry[0]):
        if total <= MAX_TRITON_BYTES:
            return
        shutil.rmtree(folder, ignore_errors=True)
        total -= size


def warmup(model, directory: str | os.PathLike, batch_sizes=(1, 32, 128), prompt_len: int = 256,
           config=None) -> Path | None:
    """Decode random prompts of `prompt_len` tokens at each batch size with `config` (None: the model's defaults,
    64 new tokens, every one decoded: no stop ids), so every compile those calls need happens now, and save the
    artifacts to `directory`."""
    if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes={batch_sizes!r}: pass positive integers (e.g. (1, 32, 128)).")
    load(model, directory, background=False)
    config = config if config is not None else BlockDiffusionConfig(max_new_tokens=64, eos_token_id=[])
    text = model.config.get_text_config()
    top = min(text.vocab_size, getattr(text, "mask_token_id", None) or text.vocab_size) - 1
    generator = torch.Generator().manual_seed(0)
    for batch in batch_sizes:
        ids = torch.randint(0, top, (batch, prompt_len), generator=generator).to(model.device)
        model.generate_multi_block(ids, config)
    free_cache(model)
    return save(model, directory)
