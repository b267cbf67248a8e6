"""Several processes on the CPU (gloo): data parallelism through the CLI and tensor parallelism with tp_plan="auto"
give the single-process outputs. Each test launches `torchrun --nproc_per_node 2` (about 10 s)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_blockdiff.integrations.checkpoint import load_pretrained
from hf_blockdiff.integrations.completions import complete

from distributed_worker import CFG, PROMPTS
from helpers import save_checkpoint


def torchrun(*args, timeout=120):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *map(str, args)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def expected(checkpoint):
    model, tokenizer = load_pretrained(str(checkpoint))
    return [c.text for c in complete(model, PROMPTS, CFG, tokenizer)]


def test_data_parallel_cli_matches_one_process(checkpoint, expected, tmp_path):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    run = torchrun("-m", "hf_blockdiff.cli", "generate", "--model", checkpoint, "--input", source, "--output", output,
             "--batch-size", 2, "--max-new-tokens", 8, "--threshold", 0.6, "--eos-token-id")
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["prompt"] for r in records] == PROMPTS
    assert [r["completion"] for r in records] == expected
    assert "2/2" in run.stderr and "3/3" not in run.stderr  # the main process's bar: 3 of the 5 prompts, 2 batches


def test_tensor_parallel_matches_one_process(checkpoint, expected, tmp_path):
    uneven = save_checkpoint(tmp_path / "one-kv-head", num_key_value_heads=1)
    report_path = tmp_path / "report.json"
    torchrun(Path(__file__).parent / "distributed_worker.py", checkpoint, uneven, report_path)
    report = json.loads(report_path.read_text())
    assert report["tp_size"] == 2
    assert report["cache_kv_heads"] == 1  # the tiny model has 2 KV heads: one per process
    assert report["completions"] == expected
    assert "num_key_value_heads=1 is not divisible by 2" in report["uneven_error"]
