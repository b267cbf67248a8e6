"""Several processes on the CPU (gloo): data parallelism through the CLI, tensor parallelism with tp_plan="auto" and
both at once (2 groups of 2) give the single-process outputs. Each test launches `torchrun` (about 10 s)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_blockdiff.integrations.checkpoint import load_pretrained
from hf_blockdiff.integrations.completions import complete

from distributed_worker import CFG, PROMPTS
from helpers import save_checkpoint


def torchrun(*args, processes=2, timeout=120):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
               *map(str, args)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def expected(checkpoint):
    model, tokenizer = load_pretrained(str(checkpoint))
    return [c.text for c in complete(model, PROMPTS, CFG, tokenizer)]


@pytest.mark.parametrize(("processes", "tp_size"), [(2, 1), (4, 2)], ids=["dp2", "tp2xdp2"])
def test_data_parallel_cli_matches_one_process(checkpoint, expected, tmp_path, processes, tp_size):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    run = torchrun("-m", "hf_blockdiff.cli", "generate", "--model", checkpoint, "--input", source, "--output", output,
                   "--batch-size", 2, "--max-new-tokens", 8, "--threshold", 0.6, "--eos-token-id",
                   "--tensor-parallel-size", tp_size, processes=processes, timeout=240)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["completion"] for r in records] == expected
    assert "2/2" in run.stderr and "3/3" not in run.stderr  # the main process's bar: 3 of the 5 prompts, 2 batches


@pytest.mark.parametrize("processes", [2, 4], ids=["tp2", "tp2xdp2"])
def test_tensor_parallel_matches_one_process(checkpoint, expected, tmp_path, processes):
    uneven = save_checkpoint(tmp_path / "one-kv-head", num_key_value_heads=1)
    report_path = tmp_path / "report.json"
    compiled = ["compiled"] if processes == 2 else []  # compiling takes about 30 s on the CPU: once
    torchrun(Path(__file__).parent / "distributed_worker.py", checkpoint, uneven, 2, report_path, *compiled,
             processes=processes, timeout=300)
    reports = [json.loads(Path(f"{report_path}.{rank}").read_text()) for rank in range(processes)]
    # batches of 2 of the 5 prompts, then of the 1: one group decodes them all; of two groups the first decodes 3
    # prompts and the one, the second 2 prompts and nothing
    assert [r["rows"] for r in reports] == ([[2, 2, 1, 1]] * 2 if processes == 2 else [[2, 1, 1]] * 2 + [[2]] * 2)
    for report in reports:  # every process ends with every completion, in input order
        assert report["tp_size"] == 2
        assert report["cache_kv_heads"] == 1  # the tiny model has 2 KV heads: one per process
        assert report["completions"] == expected and report["again"] == expected[:1]
        assert report["compiled"] == (expected if compiled else None)
        assert "num_key_value_heads=1 is not divisible by 2" in report["uneven_error"]


def test_tensor_parallel_size_must_divide_the_launch(monkeypatch):
    from hf_blockdiff.integrations.distributed import init_tensor_parallel

    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide the launch's 4 processes"):
        init_tensor_parallel(3)
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        init_tensor_parallel(0)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="torchrun --nproc_per_node N"):
        init_tensor_parallel(2)


def test_bench_tensor_parallel(tmp_path):
    """`bench --tensor-parallel` under torchrun: random weights sharded over both processes decode the single
    process's forwards; only the first process prints its report."""
    args = ["bench", "--shape", "tiny", "--batch-size", 2, "--prompt-len", 9, "--new-tokens", 8, "--device", "cpu",
            "--dtype", "float32", "--skip-reference", "--json"]
    run = torchrun("-m", "hf_blockdiff.cli", *args, "--tensor-parallel")
    reports = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1 and reports[0]["device"] == "cpu x 2 (tensor parallel)"
    assert reports[0]["first_call"]["seconds"] > 0
    assert reports[0]["results"][0]["forwards"] == reports[0]["first_call"]["forwards"] == 12
