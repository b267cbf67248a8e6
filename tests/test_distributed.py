"""Several processes decoding together. On the CPU (gloo), wherever the tests run (their processes see no GPU): data
parallelism through the CLI, tensor parallelism with tp_plan="auto" and both at once (2 groups of 2: the library's
calls, the CLI's `generate` and its `bench` in one launch) give the single-process outputs. Marked gpu, one GPU per
process (NCCL): tensor parallelism gives one GPU's tokens (fp32), the bench shards on the device it is given, and a
launch of more processes than GPUs is refused. Each test launches `torchrun` (about 10 s)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_blockdiff.integrations import distributed
from hf_blockdiff.integrations.checkpoint import load_pretrained
from hf_blockdiff.integrations.completions import complete
from hf_blockdiff.integrations.distributed import init_tensor_parallel, load_sharded, shard_device

from distributed_worker import BENCH, CFG, GENERATE_FLAGS, PROMPTS, SAMPLED, SAMPLING_SEED
from helpers import save_checkpoint

# the CPU tests' processes see no GPU, on a GPU host too, and run Triton's kernels in its interpreter, as on a machine
# without one (tests/conftest.py)
CPU_ONLY = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
GPUS = torch.cuda.device_count()


def needs_gpus(count: int):
    return pytest.mark.skipif(GPUS < count, reason=f"needs {count} GPUs, one per process (NCCL); this machine has "
                              f"{GPUS}")


def torchrun(*args, processes=2, timeout=120, env=CPU_ONLY, check=True):
    """`torchrun` of `processes` processes; `env` None: this process's environment, GPUs in sight."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               *map(str, args)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    assert run.returncode == 0 or not check, run.stderr[-3000:]
    return run


def one_process(checkpoint, device: str) -> tuple[list[str], list[str]]:
    """The completions of PROMPTS on one process: CFG's, and SAMPLED's from SAMPLING_SEED in the worker's batches."""
    model, tokenizer = load_pretrained(str(checkpoint), device)
    greedy = [c.text for c in complete(model, PROMPTS, CFG, tokenizer)]
    torch.manual_seed(SAMPLING_SEED)
    return greedy, [c.text for c in complete(model, PROMPTS, SAMPLED, tokenizer, batch_size=2)]


@pytest.fixture(scope="module")
def expected_both(checkpoint):
    return one_process(checkpoint, "cpu")


@pytest.fixture(scope="module")
def expected(expected_both):
    return expected_both[0]


def test_data_parallel_cli_matches_one_process(checkpoint, expected, tmp_path):
    """Two processes, a group of one each (TP2 x DP2 in one launch with the library's calls:
    test_tensor_parallel_matches_one_process)."""
    run, records = generate_cli(checkpoint, tmp_path, "cpu", 2, 1, CPU_ONLY)
    check_generate_cli(run.stderr, records, expected)


def check_generate_cli(stderr: str, records: list[dict], expected: list[str]) -> None:
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["completion"] for r in records] == expected
    assert "2/2" in stderr and "3/3" not in stderr  # the main process's bar: 3 of the 5 prompts, 2 batches


def prompts_file(tmp_path) -> Path:
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return source


def generate_cli(checkpoint, tmp_path, device: str, processes: int, tp_size: int, env):
    """The CLI's `generate` of PROMPTS (CFG's settings) under torchrun: the run and its output records."""
    source, output = prompts_file(tmp_path), tmp_path / f"out-{processes}-{tp_size}.jsonl"
    run = torchrun("-m", "hf_blockdiff.cli", "generate", "--model", checkpoint, "--input", source, "--output", output,
                   *GENERATE_FLAGS, "--device", device, "--tensor-parallel-size", tp_size, processes=processes,
                   timeout=240, env=env)
    return run, [json.loads(line) for line in output.read_text().splitlines()]


def check_tensor_parallel(checkpoint, expected_both, tmp_path, processes: int, device: str, env) -> None:
    """distributed_worker.py under `torchrun` on `device`, groups of two: every process ends with the single-process
    completions (`one_process`: greedy, and sampled with top-k). Two processes also decode with compiled layers (about
    30 s on the CPU: once) and sample; four, two groups, also run the CLI's `generate` and `bench` (a launch of their
    own would cost about 25 s each on the CPU)."""
    expected, expected_sampled = expected_both
    uneven = save_checkpoint(tmp_path / "one-kv-head", num_key_value_heads=1)
    report_path = tmp_path / "report.json"
    extra = ["compiled"] if processes == 2 else ["eager", prompts_file(tmp_path)]
    torchrun(Path(__file__).parent / "distributed_worker.py", checkpoint, uneven, 2, report_path, device, *extra,
             processes=processes, timeout=300, env=env)
    reports = [json.loads(Path(f"{report_path}.{rank}").read_text()) for rank in range(processes)]
    # batches of 2 of the 5 prompts, then of the 1: one group decodes them all; of two groups the first decodes 3
    # prompts and the one, the second 2 prompts and nothing
    assert [r["rows"] for r in reports] == ([[2, 2, 1, 1]] * 2 if processes == 2 else [[2, 1, 1]] * 2 + [[2]] * 2)
    # every step scored where its logits lie, each process of a group from its half of the tiny vocabulary's 96 ids
    assert sorted(start for r in reports for start in r["vocab_shard_starts"]) == sorted([0, 48] * (processes // 2))
    # top-k sampling too, from the seeds the group's first process drew (the others' random states moved on)
    assert sorted(start for r in reports for start in r["sampled_shard_starts"]) == ([0, 48] if processes == 2 else [])
    for report in reports:  # every process ends with every completion, in input order
        assert report["tp_size"] == 2 and report["device"] == device
        assert report["cache_kv_heads"] == 1  # the tiny model has 2 KV heads: one per process
        assert report["kv_bytes_per_token"] == 2 * 2 * 1 * 16 * 4  # K and V, 2 layers, its 1 head of 16, fp32
        assert report["completions"] == expected and report["again"] == expected[:1]
        assert all(report["packed"]) and len(report["packed"]) == 4  # q/k/v and gate/up of 2 layers, side by side
        if processes == 2:  # past the kernel's rows too, through the stacked q/k/v (weights/packed_shards.py)
            assert report["wide"] == expected * 4 and min(report["stacked"]) > 0  # q/k/v and MLP forwards
        assert report["compiled"] == (expected if processes == 2 else None)
        assert report["sampled"] == (expected_sampled if processes == 2 else None)
        # the compiled layers' sums took the post-attention norm (after the attention) and the residual (after the MLP)
        assert (min(report["residual_sums"]) > 0) == (processes == 2)
        assert report["unchanged"]
        assert "num_key_value_heads=1 is not divisible by 2" in report["uneven_error"]
    if processes == 4:  # the CLI's `generate` in input order, and the bench's two prompts split between the groups
        runs = [report["command_line"] for report in reports]
        assert all(run[name]["code"] == 0 for run in runs for name in ("generate", "bench"))
        records = [json.loads(line) for line in Path(f"{tmp_path / 'in.jsonl'}.out.jsonl").read_text().splitlines()]
        check_generate_cli(runs[0]["generate"]["stderr"], records, expected)
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        check_bench_report([run["bench"]["stdout"] for run in runs], name, "4 (tensor parallel 2 x data parallel 2)")


@pytest.mark.parametrize("processes", [2, 4], ids=["tp2", "tp2xdp2"])
def test_tensor_parallel_matches_one_process(checkpoint, expected_both, tmp_path, processes):
    check_tensor_parallel(checkpoint, expected_both, tmp_path, processes, "cpu", CPU_ONLY)


@pytest.mark.gpu
@pytest.mark.parametrize("processes", [pytest.param(2, marks=needs_gpus(2)), pytest.param(4, marks=needs_gpus(4))],
                         ids=["tp2", "tp2xdp2"])
def test_tensor_parallel_on_gpus_matches_one_gpu(checkpoint, tmp_path, processes):
    """NCCL, each process on its own GPU, fp32: the tokens of the model on one GPU (compiled layers too, with CUDA
    graphs, for tp2)."""
    check_tensor_parallel(checkpoint, one_process(checkpoint, "cuda"), tmp_path, processes, "cuda", None)


@pytest.mark.gpu
@needs_gpus(2)
def test_row_parallel_sums_on_gpus_are_exact(tmp_path):
    """The row-parallel products summed over symmetric memory and NCCL (tests/all_reduce_worker.py): 48 different
    products back to back at each of six sizes (our one-shot kernel at a batch-1 step's 4 rows and at its largest
    message, torch's two-shot at the smallest and the largest it takes, NCCL beyond the buffer; the skinny GEMM's
    products and cuBLAS's written into the buffer), each alone, with a residual and with a norm after, eagerly and from
    twenty replays of a CUDA graph, one rank's memory busy beside them; not one wrong sum or norm. torch's one-shot
    kernel, which the op took for small messages until 2026-11-27, summed wrong here (docs/benchmarks.md, "Tensor
    parallel")."""
    report_path = tmp_path / "sums.json"
    torchrun(Path(__file__).parent / "all_reduce_worker.py", report_path, timeout=180, env=None)
    report = json.loads(report_path.read_text())
    assert [r["kind"] for r in report.values()] == ["one_shot"] * 9 + ["two_shot"] * 6 + ["backend"] * 3
    assert all(r["eager"] == 0 and r["replays"] == 0 for r in report.values()), report


@pytest.mark.gpu
@needs_gpus(4)
def test_cli_on_four_gpus_matches_one_gpu(tmp_path):
    """`generate` over four GPUs (NCCL, fp32), one group of four: one GPU's completions, in input order (a checkpoint of
    4 KV heads, so four processes split them; two groups of two: test_tensor_parallel_on_gpus_matches_one_gpu)."""
    four = save_checkpoint(tmp_path / "four-kv-heads", num_attention_heads=4, num_key_value_heads=4)
    _, records = generate_cli(four, tmp_path, "cuda", 4, 4, None)
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["completion"] for r in records] == one_process(four, "cuda")[0]


def test_tensor_parallel_size_must_divide_the_launch(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the launch's 4 processes"):
        init_tensor_parallel(3)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        init_tensor_parallel(0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="torchrun --nproc_per_node N"):
        init_tensor_parallel(2)


def test_more_processes_than_gpus_is_refused_before_binding(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: 2)
    bound = []
    monkeypatch.setattr(torch.accelerator, "set_device_index", bound.append)
    with pytest.raises(ValueError, match=r"runs 4 processes on a machine with 2 GPU\(s\): launch at most 2 "):
        init_tensor_parallel(2, "cuda")
    assert bound == []


def test_cpu_shards_on_a_cuda_build(monkeypatch):
    """transformers places tp_plan shards on torch's built-in accelerator; load_sharded shows it the CPU for CPU
    shards while it loads, and nothing else."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(torch._C, "_get_accelerator", lambda check=None: torch.device("cuda"))
    seen = []

    class Model:
        @classmethod
        def from_pretrained(cls, path, distributed_config, **kwargs):
            seen.append((path, torch._C._get_accelerator().type, distributed_config.tp_size, kwargs))
            return cls

        @classmethod
        def modules(cls):  # what load_sharded's stacking of shards walks: no layers
            return iter(())

    assert load_sharded(Model, "dir", 2, "cpu", dtype="float32") is Model
    assert seen == [("dir", "cpu", 2, {"dtype": "float32"})]
    assert torch._C._get_accelerator().type == "cuda"  # restored
    assert shard_device("cuda:1") == "cuda" and shard_device("cpu") == "cpu"
    assert shard_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")


def bench_tensor_parallel(device: str, env, **launch):
    return torchrun("-m", "hf_blockdiff.cli", *BENCH, "--device", device, env=env, **launch)


def check_bench_report(stdouts: list[str], device_name: str, kind: str = "2 (tensor parallel)") -> None:
    """Only the first process reports (`stdouts`: of the launch, or of each process); the sharded random weights
    decode the single process's forwards; data-parallel groups report their tokens together."""
    reports = [json.loads(line) for stdout in stdouts for line in stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1 and reports[0]["device"] == f"{device_name} x {kind}"
    assert reports[0]["first_call"]["seconds"] > 0
    assert reports[0]["results"][0]["forwards"] == reports[0]["first_call"]["forwards"] == 12
    assert reports[0]["results"][0]["tokens"] == 16 and reports[0]["results"][0]["rows"] == 2


@pytest.mark.gpu
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=needs_gpus(2)), "cpu"])
def test_bench_tensor_parallel_on_a_gpu_host(device):
    """With GPUs in sight the bench shards where --device says: cuda over NCCL, each process on its own GPU (the
    prompts on the model's GPU), or the CPU over gloo."""
    run = bench_tensor_parallel(device, None)
    check_bench_report([run.stdout], torch.cuda.get_device_name() if device == "cuda" else "cpu")


@pytest.mark.gpu
def test_more_processes_than_gpus_is_refused():
    run = bench_tensor_parallel("cuda", None, processes=GPUS + 1, check=False)
    assert run.returncode != 0
    assert f"this launch runs {GPUS + 1} processes on a machine with {GPUS} GPU(s)" in run.stderr
