"""Launch configurations fitted to the device's shared memory (kernels/device_limits.py) and the launch's step down
to a smaller configuration where one does not load (kernels/compile_ahead.py)."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_blockdiff.kernels import compile_ahead, moe_experts, paged_attention, skinny_gemm
from hf_blockdiff.kernels.device_limits import assumed_shared_memory, fitting, shared_memory_limit, shrinking

pytest.importorskip("triton")
from triton.runtime.errors import OutOfResources  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
H100 = 232448  # opt-in shared memory per block: H100 and H200 (227 KiB)
LIMITS = {"H100/H200": H100, "A100": 166912, "consumer": 101376}
MODELS = {  # hidden, intermediate, query heads, KV heads (head dim 128)
    "SDAR-8B": (4096, 12288, 32, 8),
    "SDAR-4B": (2560, 9728, 32, 8),
    "SDAR-8B TP2": (4096, 6144, 16, 4),  # a tensor-parallel rank's shards
    "SDAR-8B TP4": (4096, 3072, 8, 2),
    "wide": (8192, 28672, 64, 8),
}


def test_shrinking_steps_each_parameter_down_to_its_floor_in_turn():
    configs = shrinking({"BLOCK_K": 128, "num_stages": 3, "BLOCK_N": 32}, (("BLOCK_K", 64), ("num_stages", 2),
                                                                          ("BLOCK_N", 16)))
    assert [tuple(config.values()) for config in configs] == [(128, 3, 32), (64, 3, 32), (64, 2, 32), (64, 2, 16)]


def test_fitting_keeps_what_fits_from_the_first_on():
    configs = [{"BLOCK": 256}, {"BLOCK": 128}, {"BLOCK": 64}]
    size = lambda config: config["BLOCK"] * 1000  # noqa: E731
    assert fitting(configs, size, 130_000) == ({"BLOCK": 128}, {"BLOCK": 64})
    assert fitting(configs, size, None) == tuple(configs)  # no limit (the interpreter)
    assert fitting(configs, size, 1_000) == ({"BLOCK": 64},)  # none fits: the smallest, for the load to judge


def test_assumed_shared_memory_overrides_every_device():
    assert shared_memory_limit(torch.device("cpu")) is None
    with assumed_shared_memory(101376):
        assert shared_memory_limit("cpu") == 101376
        with assumed_shared_memory(H100):
            assert shared_memory_limit(torch.device("cuda", 0)) == H100
        assert shared_memory_limit("cpu") == 101376
    assert shared_memory_limit("cpu") is None
    with pytest.raises(ValueError, match="positive number of bytes"):
        with assumed_shared_memory(0):
            pass
    with pytest.raises(TypeError, match="int of bytes"):
        with assumed_shared_memory(99.0):
            pass


def _skinny_choices(model: str, element_size: int, limit: int) -> dict:
    """{(projection, BLOCK_M): (first configuration, its estimate)} of a decoder layer's skinny GEMMs (the o and
    down projections run up to 16 rows)."""
    hidden, inner, heads, kv_heads = MODELS[model]
    projections = (("qkv", (heads + 2 * kv_heads) * 128, hidden, False), ("gate_up", 2 * inner, hidden, True),
                   ("down", hidden, inner, False), ("o", hidden, heads * 128, False))
    choices = {}
    for block_m in (16, 32, 64):
        for name, n_out, width, gated in projections[:4 if block_m == 16 else 2]:
            config = skinny_gemm._configs(n_out, width, gated, block_m, element_size, limit)[0]
            choices[name, block_m] = config, skinny_gemm._shared_bytes(config, block_m, gated, element_size)
    return choices


def _attention_choices(element_size: int, limit: int) -> dict:
    """{(head dim, query rows, splits): (first configuration, its estimate)} of paged attention."""
    choices = {}
    q = type("Q", (), {"device": torch.device("cuda", 0), "element_size": lambda self: element_size})()
    for head_dim in (128, 256, 512):
        row_bytes = head_dim * element_size
        with assumed_shared_memory(limit):
            wide = paged_attention._wide_tiles(head_dim, q)
        for rows, splits in ((16, 1), (16, 8), (128, 1), (128, 4), (1024, 1)):
            block_m = paged_attention._block_m(rows, row_bytes, wide)
            config = paged_attention._configs(block_m, row_bytes, wide, splits, limit)[0]
            choices[head_dim, rows, splits] = config, paged_attention._shared_bytes(config, row_bytes)
    return choices


@pytest.mark.parametrize("limit", LIMITS.values(), ids=LIMITS.keys())
@pytest.mark.parametrize("element_size", [2, 4], ids=["16-bit", "fp32"])
@pytest.mark.parametrize("model", MODELS)
def test_every_choice_fits(model, element_size, limit):
    """Skinny GEMMs at the model's widths, paged attention at head dims 128 to 512, the MoE experts GEMM: the
    estimate of each first choice is within the limit."""
    choices = list(_skinny_choices(model, element_size, limit).values())
    choices += list(_attention_choices(element_size, limit).values())
    for block_m in (16, 32, 64):
        for long_rows in (False, True):
            for gated in (False, True):
                config = moe_experts._configs(block_m, long_rows, gated, element_size, limit)[0]
                choices.append((config, moe_experts._shared_bytes(config, gated, element_size)))
    assert all(estimate <= limit for _, estimate in choices), [c for c in choices if c[1] > limit]


def test_sdar_4b_keeps_todays_choices_on_h100():
    """The configurations measured on an H200 at SDAR-4B's shapes all fit 227 KiB: none changes."""
    chosen = {key: tuple(config.values()) for key, (config, _) in _skinny_choices("SDAR-4B", 2, H100).items()}
    assert chosen == {  # (BLOCK_N, BLOCK_K, num_stages)
        ("qkv", 16): (64, 256, 4), ("qkv", 32): (64, 256, 4), ("qkv", 64): (64, 128, 4),
        ("gate_up", 16): (32, 128, 3), ("gate_up", 32): (64, 128, 3), ("gate_up", 64): (64, 128, 3),
        ("down", 16): (32, 512, 4), ("o", 16): (32, 512, 4),
    }
    attention = {key: tuple(config.values()) for key, (config, _) in _attention_choices(2, H100).items()}
    assert attention[128, 16, 8] == (16, 64, 4, 3)  # (BLOCK_M, BLOCK_N, num_warps, num_stages): a decode step
    assert attention[128, 128, 1] == (128, 32, 4, 3) and attention[128, 128, 4] == (128, 64, 8, 3)
    assert attention[256, 128, 1] == (128, 64, 8, 2) and attention[512, 1024, 1] == (64, 32, 8, 2)  # wide tiles
    assert moe_experts._configs(64, True, True, 2, H100)[0] == {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128,
                                                                 "num_stages": 3}


@pytest.mark.parametrize("model", ["SDAR-8B TP2", "SDAR-8B TP4"])
def test_tensor_parallel_shards_fit_as_chosen(model):
    """A tensor-parallel rank's shards of SDAR-8B on an H100 or H200 take the one-GPU rule's tiles at their widths
    (tiles a sweep timed faster alone made whole steps slower: docs/kernels.md, "Kernels and backends"), each
    fitting as chosen."""
    chosen = {key: tuple(config.values()) for key, (config, _) in _skinny_choices(model, 2, H100).items()}
    down = (32, 512, 4) if model == "SDAR-8B TP2" else (32, 256, 4)  # K = 6,144 or 3,072
    assert chosen == {  # (BLOCK_N, BLOCK_K, num_stages)
        ("qkv", 16): (32, 512, 4), ("qkv", 32): (32, 256, 4), ("qkv", 64): (32, 128, 4),
        ("gate_up", 16): (32, 128, 3), ("gate_up", 32): (64, 128, 3), ("gate_up", 64): (64, 128, 3),
        ("down", 16): down, ("o", 16): (32, 256, 4),
    }


def test_sdar_8b_steps_down_only_where_it_must():
    """SDAR-8B's q/k/v at width 4096 asked for 240 KiB on an H200 (K steps of 512, four stages): K steps of 256
    now; its gate/up and down keep their tiles. An A100 gets no wide attention tiles."""
    h100 = {key: tuple(config.values()) for key, (config, _) in _skinny_choices("SDAR-8B", 2, H100).items()}
    assert h100["qkv", 16] == h100["qkv", 32] == (64, 256, 4)
    assert h100["gate_up", 16] == (32, 128, 3) and h100["down", 16] == (32, 512, 4)
    a100 = _attention_choices(2, LIMITS["A100"])
    assert a100[256, 128, 1][0] == {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3}


class FakeKernel:
    """A Triton kernel whose configurations with BLOCK above `fits` do not load: launches and compiles recorded."""

    def __init__(self, fits: int):
        self.fits, self.attempts, self.compiled = fits, [], []

    def check(self, block: int) -> None:
        if block > self.fits:
            raise OutOfResources(block * 1024, self.fits * 1024, "shared memory")

    def __getitem__(self, grid):
        def run(*args, BLOCK, **kwargs):
            self.attempts.append((grid, BLOCK))
            self.check(BLOCK)

        return run

    def warmup(self, *args, grid, BLOCK, **kwargs):
        self.compiled.append(BLOCK)
        return type("Compiled", (), {"_init_handles": lambda compiled: self.check(BLOCK)})()


CONFIGS = ({"BLOCK": 128}, {"BLOCK": 64}, {"BLOCK": 32})


def _grid(config):
    return (256 // config["BLOCK"],)


def test_a_launch_that_does_not_load_steps_down_and_remembers():
    kernel, x = FakeKernel(fits=64), torch.zeros(2)
    compile_ahead.launch(kernel, _grid, x, configs=CONFIGS, FLAG=True)
    compile_ahead.launch(kernel, _grid, x, configs=CONFIGS, FLAG=True)
    assert kernel.attempts == [((2,), 128), ((4,), 64), ((4,), 64)]  # the second goes straight to what loaded
    compile_ahead.launch(kernel, _grid, x, configs=CONFIGS, FLAG=False)  # other keywords: tried afresh
    assert kernel.attempts[3:] == [((2,), 128), ((4,), 64)]


def test_a_launch_where_nothing_loads_says_so():
    with pytest.raises(RuntimeError, match="none of its 3 configurations fits") as raised:
        compile_ahead.launch(FakeKernel(fits=16), _grid, torch.zeros(2), configs=CONFIGS)
    assert isinstance(raised.value.__cause__, OutOfResources)


def test_compiling_ahead_steps_down_at_loading(monkeypatch):
    """Ahead, the first choice compiles in the pool; loading it fails, so the next compiles and loads, and the real
    launch goes straight to it."""
    monkeypatch.setattr(compile_ahead, "can_compile_ahead", lambda device: True)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    kernel, x = FakeKernel(fits=32), torch.zeros(2)
    with compile_ahead.compiling_ahead(torch.device("cpu")):
        compile_ahead.launch(kernel, _grid, x, configs=CONFIGS)
        assert kernel.compiled == [128] and kernel.attempts == []
    assert kernel.compiled == [128, 64, 32]
    compile_ahead.launch(kernel, _grid, x, configs=CONFIGS)
    assert kernel.attempts == [((8,), 32)]


COMPILE = r"""
import json
from concurrent.futures import ThreadPoolExecutor
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from hf_blockdiff.kernels import moe_experts, paged_attention, skinny_gemm

def allocated(fn, types, constants, config):
    '''Shared memory Triton gives `fn` compiled for sm_90, every pointer and integer a multiple of 16.'''
    constants = {**constants, **{k: v for k, v in config.items() if k.startswith("BLOCK")}}
    names = fn.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names if signature[n] not in ("constexpr", "fp32")}
    source = ASTSource(fn, signature, {(names.index(k),): v for k, v in constants.items()}, attrs)
    options = {"num_warps": config.get("num_warps", 4), "num_stages": config["num_stages"]}
    return compile(source, target=GPUTarget("cuda", 90, 32), options=options).metadata.shared

jobs = []  # (name, estimate, kernel, types, constants, config), compiled two at a time (ptxas is a process)
skinny = {n: "*bf16" for n in skinny_gemm._skinny_kernel.arg_names[:11]}
for n_out, width, gated, block_m in ((6144, 4096, False, 16), (6144, 4096, False, 32), (6144, 4096, False, 64),
                                     (24576, 4096, True, 64), (4096, 12288, False, 16)):
    config = skinny_gemm._configs(n_out, width, gated, block_m, 2, H100)[0]
    constants = dict(HAS_BIAS=False, GATED=gated, IEEE=False, GDC=True, HAS_RESIDUAL=not gated, BLOCK_M=block_m)
    jobs.append((f"skinny {n_out}x{width} rows {block_m}", skinny_gemm._shared_bytes(config, block_m, gated, 2),
                 skinny_gemm._skinny_kernel, skinny, constants, config))
config = moe_experts._configs(64, True, True, 2, H100)[0]
experts = {"x_ptr": "*bf16", "order_ptr": "*i32", "offsets_ptr": "*i32", "w_ptr": "*bf16", "y_ptr": "*bf16"}
jobs.append(("moe experts", moe_experts._shared_bytes(config, True, 2), moe_experts._experts_kernel, experts,
             dict(ACT=1, IEEE=False), config))
attention = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "part_o_ptr": "*fp32",
             "part_ml_ptr": "*fp32", "pt_ptr": "*i32", "lim_ptr": "*i32", "start_ptr": "*i32", "qk_scale": "fp32"}
for head_dim, wide in ((128, False), (256, True)):
    config = paged_attention._configs(128, 2 * head_dim, wide, 1, H100)[0]
    constants = dict(GROUP=4, PAGE_SIZE=64, HEAD_DIM=head_dim, BLOCK_D=head_dim, SPLIT=False, DOT_PRECISION="tf32",
                     HAS_START=True, GDC=True)
    jobs.append((f"attention {head_dim}", paged_attention._shared_bytes(config, 2 * head_dim),
                 paged_attention._paged_attention_kernel, attention, constants, config))
with ThreadPoolExecutor(2) as pool:
    shared = list(pool.map(lambda job: allocated(*job[2:]), jobs))
print(json.dumps([(name, estimate, used) for (name, estimate, *_), used in zip(jobs, shared)]))
"""


def test_estimates_bound_what_triton_allocates(tmp_path):
    """Compiled for sm_90 (no GPU needed), each kernel's H100 choice at SDAR-8B's shapes takes no more shared memory
    than its estimate says, and fits: the q/k/v projection that asked for 240 KiB no longer does."""
    pytest.importorskip("triton.backends.nvidia")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", f"H100 = {H100}\n{COMPILE}"], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == 8
    assert all(allocated <= estimate <= H100 for _, estimate, allocated in report), report
