"""Compiling ahead (kernels/compile_ahead.py, generation/graphs.compile_ahead): launches inside compile instead of
running; a cold process's decode compiles its step's kernels in the pool and none at its steps, with the tokens of
eager sdpa."""

import json
import os
import subprocess
import sys
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
    graphs.compile_ahead(lambda: ran.append(1), torch.device("cpu"), cache, "norms")
    if torch.cuda.is_available():
        graphs.compile_ahead(lambda: ran.append(1), torch.device("cuda"), cache, "norms")
    assert ran == [] and not cache.fully_allocated


COLD_DECODE = """
import json, sys, threading
import torch, triton.compiler
sys.path.insert(0, sys.argv[1])
from helpers import MASK, tiny_model, random_prompts, left_pad
from hf_blockdiff import BlockDiffusionConfig
from hf_blockdiff.generation import graphs

phase, compiles, compile = ["before"], [], triton.compiler.compile
def counting(src, *args, **kwargs):
    compiles.append((src.fn.__name__, threading.current_thread().name, phase[0]))
    return compile(src, *args, **kwargs)
triton.compiler.compile = counting
ahead = graphs.compile_ahead
def marked(*args):
    phase[0] = "ahead"; ahead(*args); phase[0] = "steps"
graphs.compile_ahead = marked

model = tiny_model("qwen3").cuda()
ids, mask = left_pad(random_prompts((9,), seed=31))
def run(**settings):
    cfg = BlockDiffusionConfig(mask_token_id=MASK, block_size=4, max_new_tokens=16, threshold=0.6, eos_token_id=[],
                               attention="block_causal",
                               **settings)
    return model.generate_multi_block(ids.cuda(), cfg, attention_mask=mask.cuda()).tolist()
graphed = run(attention_backend="triton", cuda_graphs=True, compile=False)
phase[0] = "reference"
print(json.dumps({"compiles": compiles, "equal": graphed == run(attention_backend="sdpa", cuda_graphs=False)}))
"""


@pytest.mark.gpu
def test_a_cold_decode_compiles_its_step_ahead(tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", COLD_DECODE, str(ROOT / "tests")], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    by_phase = {p: [(name, thread) for name, thread, at in report["compiles"] if at == p] for p in
                ("before", "ahead", "steps")}
    assert report["equal"]
    assert by_phase["ahead"], report  # the step's kernels: paged attention, scoring, ...
    assert all(thread.startswith("hf_blockdiff_compile") for _, thread in by_phase["ahead"]), by_phase
    assert by_phase["steps"] == [], by_phase  # nothing left to compile when the steps run
