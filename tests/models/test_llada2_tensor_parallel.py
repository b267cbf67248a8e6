"""LLaDA2 under tensor parallelism (tp_plan="auto", 2 processes on the CPU with gloo): the experts are split by
transformers' MoE plan and the batch decodes (editing on) to the single-process tokens (about 15 s)."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from llada2_tp_worker import CFG, MASK, PROMPTS
from released_checkpoints import llada2_config, sharp_state, write_checkpoint
from transformers import AutoModelForCausalLM


def test_tensor_parallel_llada2_matches_one_process(tmp_path):
    config = llada2_config()
    checkpoint = write_checkpoint(tmp_path / "llada2", config, sharp_state(config))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    expected = model.generate_multi_block(PROMPTS, CFG, attention_mask=MASK, return_dict=True)
    report_path = tmp_path / "report.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(Path(__file__).parent / "llada2_tp_worker.py"), str(checkpoint), str(report_path)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["tp_size"] == 2
    # each process holds half of every expert's [gate | up] rows: moe_intermediate_size of 2 * moe_intermediate_size
    assert report["gate_up_proj"] == [config["num_experts"], config["moe_intermediate_size"], config["hidden_size"]]
    assert report["tokens"] == expected.sequences.tolist()
    assert report["edits"] == expected.edits.tolist() and sum(report["edits"]) > 0
