"""Compiling ahead (kernels/compile_ahead.py, generation/graphs.compile_ahead): launches inside compile instead of
running; a cold process's decode compiles its step's kernels in the pool and none at its steps, with the tokens of
eager sdpa."""

import itertools
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from hf_blockdiff.generation import graphs
from hf_blockdiff.kernels import compile_ahead

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]


class RecordingKernel:
    """A stand-in for a Triton JITFunction that records launches and compiles."""

    def __init__(self):
        self.launched, self.compiled = [], []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launched.append((grid, args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.compiled.append((grid, args, kwargs))


def test_launch_runs_outside_and_compiles_inside(monkeypatch):
    monkeypatch.setattr(compile_ahead, "can_compile_ahead", lambda device: True)
    kernel = RecordingKernel()
    compile_ahead.launch(kernel, (3,), 1, 2, BLOCK=4)
    with compile_ahead.compiling_ahead(torch.device("cpu")):
        compile_ahead.launch(kernel, (5,), 6, BLOCK=8)
    compile_ahead.launch(kernel, (7,), 9)
    assert kernel.launched == [((3,), (1, 2), {"BLOCK": 4}), ((7,), (9,), {})]
    assert kernel.compiled == [((5,), (6,), {"BLOCK": 8})]


def test_compiling_ahead_needs_cuda():
    assert not compile_ahead.can_compile_ahead(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="can_compile_ahead"):
        with compile_ahead.compiling_ahead(torch.device("cpu")):
            pass


def test_compile_ahead_skips_what_it_cannot_capture():
    """Off CUDA, or with a layer's pools not yet allocated, the program is not run at all."""
    from hf_blockdiff.cache import PagedBlockCache

    ran = []
    cache = PagedBlockCache(2, 16)
    graphs.compile_ahead(lambda: ran.append(1), torch.device("cpu"), cache)
    if torch.cuda.is_available():
        graphs.compile_ahead(lambda: ran.append(1), torch.device("cuda"), cache)
    assert ran == [] and not cache.fully_allocated


def _plus_one(x):
    return x + 1


def test_compiled_code_runs_as_written_inside_a_compile_ahead(tmp_path):
    """What compile_ahead's thrown-away capture runs: torch.compile'd functions and compile-cache artifacts as written,
    nothing traced (a capture must not compile, nor run compiled kernels for the first time)."""
    from torch._dynamo.utils import counters

    from hf_blockdiff.fusion import ahead_of_time

    compiled = torch.compile(_plus_one, backend="eager")
    ahead = ahead_of_time.AheadOfTime("plus_one", _plus_one, "tests", globals())
    x, frames = torch.ones(3), counters["frames"]["ok"]
    ahead_of_time.use_directory(tmp_path)
    try:
        with ahead_of_time.running_as_written():
            assert ahead.variant("key", (x,), {}) is ahead_of_time.EAGER
            assert torch.equal(compiled(x), x + 1)
        assert counters["frames"]["ok"] == frames and not list(tmp_path.rglob("*.bin"))
        compiled(x)  # outside: compiled as usual
        assert counters["frames"]["ok"] == frames + 1
    finally:
        ahead_of_time.use_directory(None)


def test_each_size_class_compiles_ahead_once_per_model(monkeypatch):
    """A step compiles ahead where its forward's size class (the skinny GEMMs' tile, Triton's divisibility by 16) is
    new to the model in the process; one whose compile ahead did not run (pools not yet allocated) tries again."""
    ran, runs = [], itertools.chain([False], itertools.repeat(True))
    monkeypatch.setattr(graphs, "compile_ahead", lambda program, device, cache: ran.append(program) or next(runs))
    monkeypatch.setattr(graphs, "_COMPILED_AHEAD", weakref.WeakKeyDictionary())
    first, second = torch.nn.Module(), torch.nn.Module()
    for model, tokens in [(first, 128), (first, 128), (first, 96), (first, 120), (first, 64), (first, 40),
                          (first, 4), (first, 8), (first, 1), (second, 128)]:
        graphs.compile_ahead_once((model, tokens), torch.device("cuda"), None, model, tokens)
    assert ran == [(first, 128), (first, 128), (first, 120), (first, 64), (first, 40), (first, 4), (first, 8),
                   (first, 1), (second, 128)]
    assert [graphs.size_class(t) for t in (1, 4, 16, 17, 64, 65, 120, 4096)] == [
        (16, 0), (16, 4), (16, 16), (32, 1), (64, 16), (128, 1), (128, 8), (128, 16)]


def test_a_program_that_fails_ahead_is_said_and_left_to_its_steps(monkeypatch):
    """Compiling ahead only saves time: a program raising inside the thrown-away capture warns, nothing else."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    monkeypatch.setattr(graphs, "can_compile_ahead", lambda device: True)
    monkeypatch.setattr(graphs, "compiling_ahead", lambda device: nullcontext())
    monkeypatch.setattr(graphs, "capturing", lambda graph, **kwargs: nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", object)

    def program():
        raise RuntimeError("a per-layer attribute")

    with pytest.warns(UserWarning, match=r"ahead failed \(RuntimeError: a per-layer attribute\); they compile one"):
        assert graphs.compile_ahead(program, torch.device("cuda"), SimpleNamespace(fully_allocated=True))


COLD_DECODE = """
import json, sys, threading
import torch, triton.compiler
sys.path.insert(0, sys.argv[1])
from helpers import MASK, tiny_model, random_prompts, left_pad
from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.generation import graphs

phase, compiles, compile = ["other"], [], triton.compiler.compile  # other: prefills, the reference
def counting(src, *args, **kwargs):
    compiles.append((src.fn.__name__, threading.current_thread().name, phase[0]))
    return compile(src, *args, **kwargs)
triton.compiler.compile = counting
def marked(function, name):
    def run(*args):
        before, phase[0] = phase[0], name
        try:
            return function(*args)
        finally:
            phase[0] = before
    return run
graphs.compile_ahead = marked(graphs.compile_ahead, "ahead")
graphs.StepGraphs.step = marked(graphs.StepGraphs.step, "steps")

model = tiny_model("qwen3").cuda()
calls = [left_pad(random_prompts((9,) * 20, seed=31)), left_pad(random_prompts((9, 5), seed=32))]
def run(ids, mask, **settings):
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=16, threshold=0.6, eos_token_id=[],
                               attention="block_causal",
                               **settings)
    return model.generate_multi_block(ids.cuda(), cfg, attention_mask=mask.cuda()).tolist()
# 80 tokens a forward, then 8: the second call's skinny GEMMs are the process's first
graphed = [run(*call, attention_backend="triton", cuda_graphs=True, compile=sys.argv[2] == "compiled")
           for call in calls]
equal = graphed == [run(*call, attention_backend="sdpa", cuda_graphs=False) for call in calls]
print(json.dumps({"compiles": compiles, "equal": equal}))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("layers", ["eager", "compiled"])
def test_a_cold_decode_compiles_its_step_ahead(tmp_path, layers):
    """Two calls of a cold process, the second's forwards narrower (the skinny GEMMs' first): every kernel of ours
    compiles ahead, in the pool's threads, none as the steps meet it; with compiled layers too (which run as written
    inside the thrown-away capture; inductor's own kernels compile with the layers)."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PYTHONPATH": str(ROOT),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    done = subprocess.run([sys.executable, "-c", COLD_DECODE, str(ROOT / "tests"), layers], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    by_phase = {p: [(name, thread) for name, thread, at in report["compiles"]
                    if at == p and not name.startswith("triton_")] for p in ("ahead", "steps")}
    assert report["equal"]  # fp32: compiled layers round within what the threshold sees
    assert by_phase["ahead"], report  # the step's kernels: paged attention, scoring, ...
    assert all(thread.startswith("hf_blockdiff_compile") for _, thread in by_phase["ahead"]), by_phase
    assert by_phase["steps"] == [], by_phase  # nothing left to compile when the steps run, the second call's too
    assert "_skinny_kernel" in {name for name, _ in by_phase["ahead"]}  # the second call's skinny GEMMs
